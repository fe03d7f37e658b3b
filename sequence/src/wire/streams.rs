//! The streams of a session beyond its first connection (part of [`super`]): the receiver's
//! registry of sessions they may join, and each stream's connection and MAC.

use super::*;
use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex, PoisonError};

/// A stream's connection as the receiver reads it.
type Conn = Box<dyn Read + Send>;

/// A stream of a session, as its receiver holds it: its connection and the MAC of its frames.
pub(super) struct RecvLane {
    pub conn: Conn,
    pub mac: FrameMac,
}

/// A stream of a session, as its sender holds it.
pub(super) struct SendLane {
    pub conn: Box<dyn Connection>,
    pub mac: FrameMac,
}

impl std::fmt::Debug for SendLane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SendLane({:?})", self.mac)
    }
}

/// A session open to joins: its key, its streams, which have joined, and where they go.
struct Open {
    key: [u8; KEY_BYTES],
    streams: u32,
    joined: Vec<bool>,
    to: mpsc::Sender<(u32, Conn)>,
}

type Registry = Arc<Mutex<HashMap<[u8; 16], Open>>>;

/// The sessions of a receiver that more streams may join: one registry shared by the threads
/// that take its connections ([`accept_handshake`]), each stream handed to its session's
/// receive ([`Joined::join`]).
#[derive(Clone)]
pub struct Sessions {
    /// None: this receiver takes sessions of one stream.
    open: Option<Registry>,
    /// How long a session's receive waits for its streams to join.
    wait: Duration,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let open = self.open.as_ref().map(|o| lock(o).len());
        write!(f, "Sessions(open {open:?}, wait {:?})", self.wait)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Sessions {
    /// Sessions of any number of streams (up to [`MAX_STREAMS`]), each of whose receives waits
    /// at most `wait` for its streams to join.
    pub fn new(wait: Duration) -> Sessions {
        Sessions {
            open: Some(Arc::default()),
            wait,
        }
    }

    /// Sessions of one stream only: a sender asking for more is refused at its handshake.
    pub fn single() -> Sessions {
        Sessions {
            open: None,
            wait: Duration::ZERO,
        }
    }

    pub(super) fn joinable(&self) -> bool {
        self.open.is_some()
    }

    /// Opens `session` to joins, until the handle returned is dropped.
    pub(super) fn open(&self, session: &Session) -> Joins {
        let registry = self.open.clone().expect("a joinable registry");
        let (to, from) = mpsc::channel();
        lock(&registry).insert(
            session.id,
            Open {
                key: session.key,
                streams: session.streams,
                joined: vec![false; session.streams as usize],
                to,
            },
        );
        Joins {
            registry,
            id: session.id,
            from,
            wait: self.wait,
        }
    }

    /// The key and the streams of the open session `id`.
    pub(super) fn find(&self, id: &[u8; 16]) -> Option<([u8; KEY_BYTES], u32)> {
        let open = self.open.as_ref()?;
        lock(open).get(id).map(|o| (o.key, o.streams))
    }

    /// Stream `index` of the open session `id` (of `has` streams), claimed by a connection that
    /// said the session has `streams`: refused unless it is one of its streams not yet joined.
    pub(super) fn claim(
        &self,
        id: &[u8; 16],
        index: u32,
        streams: u32,
        has: u32,
    ) -> Result<Joined, HandshakeError> {
        let not = |why| HandshakeError::NotAStream {
            index,
            streams: has,
            why,
        };
        if streams != has {
            return Err(not("it says the session has another number of streams"));
        }
        if index == 0 || index >= has {
            return Err(not("the session has no such stream"));
        }
        let registry = self
            .open
            .as_ref()
            .ok_or(HandshakeError::UnknownSession { index })?;
        let mut open = lock(registry);
        let o = open
            .get_mut(id)
            .ok_or(HandshakeError::UnknownSession { index })?;
        if std::mem::replace(&mut o.joined[index as usize], true) {
            return Err(not("that stream has joined already"));
        }
        Ok(Joined {
            index,
            to: o.to.clone(),
        })
    }
}

/// A connection that joined a session as one of its streams: hand it over with
/// [`Joined::join`].
#[derive(Debug)]
pub struct Joined {
    index: u32,
    to: mpsc::Sender<(u32, Conn)>,
}

impl Joined {
    /// The stream it is.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Hands `conn` (its reads bounded) to its session's receive; false if that receive is
    /// over.
    pub fn join(self, conn: impl Read + Send + 'static) -> bool {
        self.to.send((self.index, Box::new(conn))).is_ok()
    }
}

/// A receiver's session open to joins: closed to them when dropped.
pub(super) struct Joins {
    registry: Registry,
    id: [u8; 16],
    from: mpsc::Receiver<(u32, Conn)>,
    wait: Duration,
}

impl Drop for Joins {
    fn drop(&mut self) {
        lock(&self.registry).remove(&self.id);
    }
}

impl Session {
    /// The session's streams beyond its first connection, as they join (a receiver's), at most
    /// the registry's wait in all.
    pub(super) fn lanes(&mut self) -> Result<Vec<RecvLane>, ReceiveError> {
        let want = self.streams.saturating_sub(1) as usize;
        if want == 0 {
            return Ok(Vec::new());
        }
        let Some(joins) = self.joins.as_ref() else {
            return Err(ReceiveError::Streams {
                joined: 1,
                streams: self.streams,
                waited: Duration::ZERO,
            });
        };
        let deadline = Instant::now() + joins.wait;
        let mut got: Vec<Option<Conn>> = (0..want).map(|_| None).collect();
        let mut joined = 0;
        while joined < want {
            let left = deadline.saturating_duration_since(Instant::now());
            match joins.from.recv_timeout(left) {
                Ok((index, conn)) => {
                    got[index as usize - 1] = Some(conn);
                    joined += 1;
                }
                Err(_) => {
                    return Err(ReceiveError::Streams {
                        joined: joined as u32 + 1,
                        streams: self.streams,
                        waited: joins.wait,
                    })
                }
            }
        }
        // Every stream has joined: no more may.
        self.joins = None;
        let key = self.key;
        Ok(got
            .into_iter()
            .enumerate()
            .map(|(i, conn)| RecvLane {
                conn: conn.expect("every stream joined"),
                mac: FrameMac::new(&key, i as u32 + 1, Way::ToReceiver),
            })
            .collect())
    }

    /// Opens the session's other streams, each a connection `open` makes, and joins them to it
    /// (a sender's).
    pub(super) fn open_lanes(
        &self,
        mut open: impl FnMut(u32) -> io::Result<Box<dyn Connection>>,
    ) -> Result<Vec<SendLane>, HandshakeError> {
        (1..self.streams)
            .map(|index| {
                let mut conn =
                    open(index).map_err(|source| HandshakeError::Open { index, source })?;
                let mac = join_handshake(&mut conn, self, index)?;
                Ok(SendLane { conn, mac })
            })
            .collect()
    }
}
