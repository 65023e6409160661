//! The workload of `fastbox bench lazy`: a process holding M MiB of pseudo-random memory
//! that answers on a TCP port, and the benchmark's side of talking to it.
//!
//! It is this binary's hidden `fastbox bench lazy-holder --port P --mib M`, run inside the
//! sandbox with the dynamic loader and libraries it was linked against, which the benchmark
//! puts into the sandbox's image (see `rootfs`): a busybox shell cannot hold hundreds of MiB
//! cheaply, and no C toolchain or interpreter is needed in the image.
//!
//! Protocol: one byte per connection. `p` is answered `pong` (touches almost no memory: the
//! workload "answers"); `s` is answered `<checksum now> <checksum at start>` in hex, the
//! checksum being over every word of the memory, so every page is read.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The port the holder listens on inside the sandbox (its own network namespace).
pub const PORT: u16 = 7070;
/// The request that is answered without touching the memory.
const PING: u8 = b'p';
/// The request for the checksum of the whole memory.
const SUM: u8 = b's';

#[derive(clap::Args, Debug)]
pub struct HolderArgs {
    /// The TCP port to listen on (all addresses).
    #[arg(long, default_value_t = PORT)]
    pub port: u16,
    /// Memory to hold, in MiB.
    #[arg(long, value_name = "M")]
    pub mib: u64,
}

/// `fastbox bench lazy-holder`: fills the memory, then answers forever.
pub fn holder_main(args: HolderArgs) -> anyhow::Result<i32> {
    let words = fill(args.mib << 17, rand::random());
    let at_start = checksum(&words);
    let listener = TcpListener::bind(("0.0.0.0", args.port))
        .with_context(|| format!("listen on port {}", args.port))?;
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let mut request = [0u8; 1];
        if conn.read_exact(&mut request).is_err() {
            continue;
        }
        let answer = match request[0] {
            SUM => format!("{:016x} {at_start:016x}\n", checksum(&words)),
            _ => "pong\n".to_string(),
        };
        let _ = conn.write_all(answer.as_bytes());
    }
    Ok(0)
}

/// `n` xorshift64 words from `seed` (never 0).
fn fill(n: u64, seed: u64) -> Vec<u64> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
        .collect()
}

/// A checksum of every word in four independent lanes (so it runs near memory speed); a
/// changed word, or a page that reads as zeros, changes it.
fn checksum(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 4];
    let chunks = words.chunks_exact(4);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, word) in lanes.iter_mut().zip(chunk) {
            *lane = lane.wrapping_mul(31).wrapping_add(*word);
        }
    }
    for (lane, word) in lanes.iter_mut().zip(tail) {
        *lane = lane.wrapping_mul(31).wrapping_add(*word);
    }
    lanes
        .iter()
        .fold(0u64, |sum, lane| sum.rotate_left(17) ^ lane)
}

/// One request to the holder at `addr`; its answer.
fn ask(addr: SocketAddr, request: u8, timeout: Duration) -> std::io::Result<String> {
    let mut conn = TcpStream::connect_timeout(&addr, timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.write_all(&[request])?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer)?;
    Ok(answer)
}

/// Asks `p` every few milliseconds until the holder answers `pong`, or fails at `deadline`.
pub fn wait_answer(addr: SocketAddr, deadline: Instant) -> anyhow::Result<()> {
    loop {
        let last = match ask(addr, PING, Duration::from_secs(5)) {
            Ok(answer) if answer.trim() == "pong" => return Ok(()),
            Ok(answer) => format!("answered {answer:?}"),
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            bail!("the memory holder at {addr} does not answer: {last}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The holder's checksums: (over its memory now, over its memory when it started).
pub fn checksums(addr: SocketAddr, timeout: Duration) -> anyhow::Result<(u64, u64)> {
    let answer = ask(addr, SUM, timeout).with_context(|| format!("ask {addr} for its checksum"))?;
    parse_checksums(&answer).with_context(|| format!("{addr} answered {answer:?}"))
}

fn parse_checksums(answer: &str) -> Option<(u64, u64)> {
    let mut parts = answer
        .split_whitespace()
        .map(|p| u64::from_str_radix(p, 16).ok());
    let pair = (parts.next()??, parts.next()??);
    parts.next().is_none().then_some(pair)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checksum_sees_every_word_and_zeroed_pages() {
        let words = fill(4096, 42);
        let sum = checksum(&words);
        assert_eq!(sum, checksum(&fill(4096, 42)), "deterministic");
        assert_ne!(sum, checksum(&fill(4096, 44)));
        for at in [0, 1, 2, 3, 2048, 4095] {
            let mut changed = words.clone();
            changed[at] ^= 1;
            assert_ne!(checksum(&changed), sum, "word {at}");
        }
        let mut zeroed = words.clone();
        zeroed[512..1024].fill(0);
        assert_ne!(checksum(&zeroed), sum, "a page of zeros");
        assert_ne!(
            checksum(&words[..4093]),
            checksum(&words[..4094]),
            "tails count"
        );
    }

    #[test]
    fn a_holder_answers_pings_and_checksums() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let port = addr.port();
        std::thread::spawn(move || holder_main(HolderArgs { port, mib: 1 }));
        let local = SocketAddr::from(([127, 0, 0, 1], port));
        wait_answer(local, Instant::now() + Duration::from_secs(30)).unwrap();
        let (now, at_start) = checksums(local, Duration::from_secs(10)).unwrap();
        assert_eq!(now, at_start);
        assert!(
            wait_answer(
                SocketAddr::from(([127, 0, 0, 1], 1)),
                Instant::now() + Duration::from_millis(50)
            )
            .is_err()
        );
    }

    #[test]
    fn answers_parse_strictly() {
        assert_eq!(
            parse_checksums("00000000000000ff 0000000000000001\n"),
            Some((255, 1))
        );
        assert_eq!(parse_checksums("pong\n"), None);
        assert_eq!(parse_checksums("1 2 3"), None);
        assert_eq!(parse_checksums("1"), None);
    }
}
