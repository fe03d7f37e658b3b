//! Pre-copy: an engine's buffers, in rounds, while the job runs (part of [`super`]).

use std::io::{self, Read, Write};
use std::path::PathBuf;

use possum_engine::image::ImageError;
use possum_engine::store::{BufferRecord, ChunkSink};

use super::answers::confirmation;
use super::error::{ReceiveError, SendError};
use super::handoff::{send_abort, unexpected};
use super::session::{
    read_frame, send_frame, write_frame, Frame, FrameError, Session, Totals, CHUNK_BYTES,
};

/// The sending end of a pre-copy, after [`sender_handshake`]: an engine's [`ChunkSink`] whose
/// every declaration and chunk goes out at once as a `Buffer` or `BufferChunk` frame (at most
/// [`CHUNK_BYTES`] of bytes each), under the session's MAC; [`PrecopySender::finish`] sends
/// `Done` (totals: the `Buffer` frames, the bytes of the `BufferChunk` frames) and checks the
/// receiver's `Committed`. The engine's copier threads share it (one frame at a time).
pub struct PrecopySender<S> {
    inner: std::sync::Mutex<PrecopyState<S>>,
}

pub(super) struct PrecopyState<S> {
    stream: S,
    session: Session,
    sent: Totals,
}

impl<S> std::fmt::Debug for PrecopySender<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrecopySender(..)")
    }
}

/// A frame that could not be sent, as the engine's sink reports it.
pub(super) fn sink_error(e: FrameError) -> ImageError {
    ImageError::Io {
        path: PathBuf::from("(the migration stream)"),
        source: io::Error::other(e.to_string()),
    }
}

impl<S: Read + Write + Send> PrecopySender<S> {
    /// Pre-copies over `stream`, whose handshake gave `session`.
    pub fn new(stream: S, session: Session) -> PrecopySender<S> {
        PrecopySender {
            inner: std::sync::Mutex::new(PrecopyState {
                stream,
                session,
                sent: Totals::default(),
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PrecopyState<S>> {
        // A copier thread that panicked mid-frame leaves a stream the receiver will refuse.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What was sent so far: `Buffer` frames and chunk bytes.
    pub fn sent(&self) -> Totals {
        self.state().sent
    }

    /// Sends `Done` and waits for the receiver's `Committed`: returns its totals (those sent)
    /// and the stream once the receiver has committed every buffer sent.
    pub fn finish(self) -> Result<(Totals, S), SendError> {
        let mut st = self.inner.into_inner().unwrap_or_else(|p| p.into_inner());
        let PrecopyState {
            stream,
            session,
            sent,
        } = &mut st;
        write_frame(stream, session, &Frame::Done(*sent))?;
        stream.flush().map_err(|source| FrameError::Io {
            what: "sending",
            source,
        })?;
        let totals = confirmation(stream, session, sent)?;
        Ok((totals, st.stream))
    }
}

impl<S: Read + Write + Send> ChunkSink for PrecopySender<S> {
    fn add_buffer(&self, rec: BufferRecord) -> Result<(), ImageError> {
        let mut st = self.state();
        let PrecopyState {
            stream, session, ..
        } = &mut *st;
        write_frame(stream, session, &Frame::Buffer(rec)).map_err(sink_error)?;
        st.sent.files += 1;
        Ok(())
    }

    fn write_chunk(&self, buffer: u64, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        // Hashed before the stream is taken: the copier threads hash at once.
        let hashes: Vec<blake3::Hash> = data.chunks(CHUNK_BYTES).map(blake3::hash).collect();
        let mut st = self.state();
        for (i, (piece, hash)) in data.chunks(CHUNK_BYTES).zip(hashes).enumerate() {
            let PrecopyState {
                stream, session, ..
            } = &mut *st;
            let frame = Frame::BufferChunk {
                buffer,
                offset: offset + (i * CHUNK_BYTES) as u64,
                data: piece,
            };
            send_frame(stream, &mut session.send, &frame, Some(hash)).map_err(sink_error)?;
            st.sent.bytes += piece.len() as u64;
        }
        Ok(())
    }

    fn set_meta(&self, _key: &str, _value: &str) -> Result<(), ImageError> {
        // A pre-copy carries buffers only; the job's own state travels in its process image.
        Ok(())
    }
}

/// The receiving end of a pre-copy, after [`receiver_handshake`]: writes every `Buffer` and
/// `BufferChunk` into `sink` (an image writer: a later round's chunk replaces an earlier one's)
/// until `Done`, checks `Done`'s totals against what came, then `commit`s the sink
/// (an image writer's commit: the image complete on disk) and only then answers `Committed`.
/// On an error the sender is told why (`Abort`) where the connection still stands, and the sink
/// is dropped uncommitted.
pub fn receive_precopy<S: Read + Write, K: ChunkSink, T>(
    stream: &mut S,
    session: &mut Session,
    sink: K,
    commit: impl FnOnce(K) -> Result<T, ImageError>,
) -> Result<(Totals, T), ReceiveError> {
    let got = receive_buffers(stream, session, &sink)
        .and_then(|done| Ok((done, commit(sink).map_err(ReceiveError::Sink)?)));
    match got {
        Ok((done, committed_sink)) => {
            write_frame(stream, session, &Frame::Committed(done))?;
            stream.flush().map_err(|source| FrameError::Io {
                what: "sending",
                source,
            })?;
            Ok((done, committed_sink))
        }
        Err(e) => {
            if !matches!(
                e,
                ReceiveError::Frame(FrameError::Io { .. } | FrameError::Closed)
                    | ReceiveError::Aborted { .. }
            ) {
                send_abort(stream, session, &possum_cuda::error_chain(&e));
            }
            Err(e)
        }
    }
}

pub(super) fn receive_buffers<S: Read>(
    stream: &mut S,
    session: &mut Session,
    sink: &dyn ChunkSink,
) -> Result<Totals, ReceiveError> {
    let mut got = Totals::default();
    let mut buf = Vec::new();
    let sent = loop {
        match read_frame(stream, session, &mut buf)? {
            Frame::Buffer(rec) => {
                sink.add_buffer(rec).map_err(ReceiveError::Sink)?;
                got.files += 1;
            }
            Frame::BufferChunk {
                buffer,
                offset,
                data,
            } => {
                sink.write_chunk(buffer, offset, data)
                    .map_err(ReceiveError::Sink)?;
                got.bytes += data.len() as u64;
            }
            Frame::Done(totals) => break totals,
            Frame::Abort { reason } => return Err(ReceiveError::Aborted { reason }),
            other => return Err(unexpected(other.name(), "in a pre-copy")),
        }
    };
    if sent != got {
        return Err(ReceiveError::Totals { sent, got });
    }
    Ok(sent)
}
