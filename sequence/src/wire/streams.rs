//! The streams of a session beyond its first connection, as they join it (part of
//! [`super`]; the registry they join by is the session's).

use std::io;
use std::time::{Duration, Instant};

use super::error::ReceiveError;
use super::mac::{FrameMac, Way};
use super::session::{
    join_handshake, Conn, Connection, HandshakeError, RecvLane, SendLane, Session,
};
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
