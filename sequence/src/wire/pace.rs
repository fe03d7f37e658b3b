//! Pacing (part of [`super`]): one token bucket that every stream of a transfer writes through
//! (`possum migrate --max-rate`), and the rates a user writes.

use std::io::{self, Read, Write};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A token bucket shared by the streams of a transfer: together they write at most `rate`
/// bytes a second, after a burst of at most a twentieth of a second's worth (the bucket's
/// depth, which is all an idle while saves up).
#[derive(Debug)]
pub struct Pacer {
    rate: u64,
    burst: u64,
    start: Instant,
    /// When, after `start`, the bytes taken so far are all paid for (seconds): the bucket's
    /// "theoretical arrival time".
    due: Mutex<f64>,
}

impl Pacer {
    /// A bucket of `rate` bytes a second (at least 1).
    pub fn new(rate: u64) -> Pacer {
        let rate = rate.max(1);
        Pacer {
            rate,
            burst: (rate / 20).max(1),
            start: Instant::now(),
            due: Mutex::new(0.0),
        }
    }

    /// Its rate, bytes a second.
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// The most bytes one write takes at once.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Takes `n` bytes (at most [`Pacer::burst`]) out of the bucket at `now` (after the
    /// bucket's start): how long after its start they may go.
    pub fn take_at(&self, n: u64, now: Duration) -> Duration {
        let depth = self.burst as f64 / self.rate as f64;
        let now = now.as_secs_f64();
        let mut due = self.due.lock().unwrap_or_else(PoisonError::into_inner);
        // An idle bucket fills up to its depth, no more.
        let paid = due.max(now);
        let go = (paid + n as f64 / self.rate as f64 - depth).max(now);
        *due = paid + n as f64 / self.rate as f64;
        Duration::from_secs_f64(go)
    }

    /// Gives back `n` bytes taken and not written.
    fn give_back(&self, n: u64) {
        let mut due = self.due.lock().unwrap_or_else(PoisonError::into_inner);
        *due -= n as f64 / self.rate as f64;
    }

    /// Takes `n` bytes (at most [`Pacer::burst`]), waiting until the bucket holds them.
    pub fn take(&self, n: u64) {
        let go = self.take_at(n, self.start.elapsed());
        let wait = go.saturating_sub(self.start.elapsed());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}

/// A stream whose writes take their bytes from a [`Pacer`] first (one it may share with other
/// streams). Reads pass through.
#[derive(Debug)]
pub struct Paced<S> {
    inner: S,
    pacer: Arc<Pacer>,
}

impl<S> Paced<S> {
    /// `inner`, its writes paced by `pacer`.
    pub fn new(inner: S, pacer: Arc<Pacer>) -> Paced<S> {
        Paced { inner, pacer }
    }

    /// The stream paced.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }
}

impl<S: Write> Write for Paced<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(self.pacer.burst() as usize);
        self.pacer.take(n as u64);
        let written = self.inner.write(&buf[..n]);
        let k = *written.as_ref().unwrap_or(&0);
        if k < n {
            self.pacer.give_back((n - k) as u64);
        }
        written
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<S: Read> Read for Paced<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf)
    }
}

/// A rate that is not one.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RateError {
    /// No number first.
    #[error("{0:?} is not a rate: a number and a unit, e.g. 500MB/s, 1.5GiB/s or 10Gbit")]
    NotARate(String),
    /// A unit this does not know.
    #[error(
        "{rate:?}: unknown unit {unit:?}; bytes are B, kB, MB, GB, TB (or KiB, MiB, GiB, TiB), \
         bits are bit, kbit, Mbit, Gbit, Tbit (or bps, kbps, ...), each alone or with /s \
         (e.g. 500MB/s, 10Gbit)"
    )]
    Unit {
        /// The rate written.
        rate: String,
        /// Its unit.
        unit: String,
    },
    /// A unit that could be bits or bytes.
    #[error("{rate:?}: {unit:?} could be bits or bytes: write {prefix}bit or {prefix}B")]
    Ambiguous {
        /// The rate written.
        rate: String,
        /// Its unit.
        unit: String,
        /// Its prefix (k, M, G, T).
        prefix: String,
    },
    /// Zero, or less than a byte a second.
    #[error("{0:?}: a rate is at least 1 byte a second")]
    TooSmall(String),
    /// More than any link.
    #[error("{0:?}: more bytes a second than this counts (2^64)")]
    TooLarge(String),
}

/// A rate as a user writes it (`500MB/s`, `1.5GiB/s`, `10Gbit`, `800Mbit/s`, `250000000`: a
/// number, then optionally a unit of bytes or bits, with or without `/s`): bytes a second.
/// Prefixes k, M, G, T are powers of 1000, Ki, Mi, Gi, Ti of 1024.
pub fn parse_rate(text: &str) -> Result<u64, RateError> {
    let rate = text.trim();
    let split = rate
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rate.len());
    let (number, unit) = rate.split_at(split);
    let number: f64 = number
        .parse()
        .ok()
        .filter(|n: &f64| n.is_finite())
        .ok_or_else(|| RateError::NotARate(text.to_string()))?;
    let unit = unit.trim();
    // "bps" is bits a second; "/s" and "ps" are a second.
    let base = match unit.strip_suffix("bps") {
        Some(prefix) => format!("{prefix}bit"),
        None => unit
            .strip_suffix("/s")
            .or_else(|| unit.strip_suffix("ps"))
            .unwrap_or(unit)
            .to_string(),
    };
    let base = base.as_str();
    let unknown = || RateError::Unit {
        rate: text.to_string(),
        unit: unit.to_string(),
    };
    let (prefix, per_unit) = if base.is_empty() {
        ("", 1.0)
    } else if let Some(p) = base.strip_suffix("bit") {
        (p, 1.0 / 8.0)
    } else if let Some(p) = base.strip_suffix('B') {
        (p, 1.0)
    } else if let Some(p) = base.strip_suffix('b') {
        return Err(RateError::Ambiguous {
            rate: text.to_string(),
            unit: unit.to_string(),
            prefix: p.to_string(),
        });
    } else {
        return Err(unknown());
    };
    let scale = match prefix {
        "" => 1.0,
        "k" | "K" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return Err(unknown()),
    };
    let bytes = number * scale * per_unit;
    if bytes < 1.0 {
        return Err(RateError::TooSmall(text.to_string()));
    }
    if bytes >= u64::MAX as f64 {
        return Err(RateError::TooLarge(text.to_string()));
    }
    Ok(bytes.round() as u64)
}
