//! Handing rank 0's NCCL unique id to every rank over TCP, as torchrun's `MASTER_ADDR` /
//! `MASTER_PORT` rendezvous does: no shared filesystem needed. The port is the crate's own
//! ([`rendezvous_addr_from_env`]: `MPIPEMOE_RENDEZVOUS_PORT`, or `MASTER_PORT + 1`), because
//! torchrun's agent already listens on `MASTER_PORT`.
//!
//! Rank 0 listens on every interface of its machine (IPv6 and IPv4, as torchrun's TCPStore
//! does), not on `MASTER_ADDR` alone: where its own hostname resolves to a loopback address
//! (Debian's and Ubuntu's `127.0.1.1` in `/etc/hosts`), a listener bound to `MASTER_ADDR`
//! would be out of reach of every other node. Every other rank tries each address
//! `MASTER_ADDR` resolves to, in turn, until one answers.
//!
//! Rank 0 listens; every other rank connects (retrying until rank 0 is up), introduces itself
//! with a fixed greeting, its rank and the world size, and receives the id. Rank 0 answers
//! each rank once and stops when all `world - 1` have their id or the timeout passes. A
//! connection that does not greet correctly (a port scanner, a rank of another job) is closed
//! and does not count. Every read and write is bounded in size and time; nothing blocks past
//! the timeout and nothing panics on what a peer sends.
//!
//! This module needs no CUDA, so it is compiled and tested on every machine.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use mpipemoe::{MoeError, Result};

/// The size of an NCCL unique id (`ncclUniqueId`), the payload rank 0 hands out.
pub const ID_BYTES: usize = 128;

/// What a joining rank sends first: 8 bytes of greeting, then its rank and the world size as
/// little-endian `u32`.
const GREETING: &[u8; 8] = b"mpipemoe";
const HELLO_BYTES: usize = 16;

/// How long one poll of the listener or one connection attempt waits.
const POLL: Duration = Duration::from_millis(20);

fn init_err(rank: usize, reason: impl Into<String>) -> MoeError {
    MoeError::comm("init", rank, reason)
}

/// Rank 0's listeners on `port` of every interface: `[::]` (which also takes IPv4 where the
/// system maps it, Linux's default) and `0.0.0.0` (where it does not, or where IPv6 is off).
/// Port 0 picks a free port, the same for both.
///
/// # Errors
/// Neither could be bound; the error names the port and both reasons.
pub fn listen_everywhere(port: u16) -> Result<Vec<TcpListener>> {
    let mut listeners = Vec::new();
    let v6 = TcpListener::bind((std::net::Ipv6Addr::UNSPECIFIED, port));
    let port = match &v6 {
        Ok(l) => l.local_addr().map(|a| a.port()).unwrap_or(port),
        Err(_) => port,
    };
    let v4 = TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, port));
    let reasons = match (v6, v4) {
        (Ok(a), Ok(b)) => {
            listeners.extend([a, b]);
            return Ok(listeners);
        }
        // A dual-stack `[::]` already holds the IPv4 port: "in use" is expected then.
        (Ok(a), Err(_)) => {
            listeners.push(a);
            return Ok(listeners);
        }
        (Err(_), Ok(b)) => {
            listeners.push(b);
            return Ok(listeners);
        }
        (Err(a), Err(b)) => format!("[::]:{port}: {a}; 0.0.0.0:{port}: {b}"),
    };
    Err(init_err(
        0,
        format!("cannot listen for the NCCL-id rendezvous on port {port} ({reasons}); the port is {RENDEZVOUS_PORT_VAR}, or MASTER_PORT + {RENDEZVOUS_PORT_OFFSET}"),
    ))
}

/// Rank 0's side: answers every other rank of `world` with `id` on any of `listeners`,
/// waiting at most `timeout` for all of them.
pub fn serve_id(
    listeners: &[TcpListener],
    world: usize,
    id: &[u8; ID_BYTES],
    timeout: Duration,
) -> Result<()> {
    let start = Instant::now();
    for listener in listeners {
        listener
            .set_nonblocking(true)
            .map_err(|e| init_err(0, format!("rendezvous listener: {e}")))?;
    }
    let mut served = BTreeSet::new();
    while served.len() + 1 < world {
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            let missing: Vec<usize> = (1..world).filter(|r| !served.contains(r)).collect();
            return Err(init_err(
                0,
                format!("ranks {missing:?} did not join the rendezvous within {timeout:?}"),
            ));
        }
        let mut idle = true;
        for listener in listeners {
            match listener.accept() {
                Ok((stream, _)) => {
                    idle = false;
                    // A bad greeting closes that connection only; the rendezvous goes on.
                    if let Ok(rank) = answer(stream, world, id, left.min(Duration::from_secs(5)), &served) {
                        served.insert(rank);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(init_err(0, format!("rendezvous accept: {e}"))),
            }
        }
        if idle {
            std::thread::sleep(POLL);
        }
    }
    Ok(())
}

/// Reads one greeting from `stream` and, if it names a rank of this world not yet served,
/// writes the id.
fn answer(
    mut stream: TcpStream,
    world: usize,
    id: &[u8; ID_BYTES],
    timeout: Duration,
    served: &BTreeSet<usize>,
) -> std::io::Result<usize> {
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut hello = [0u8; HELLO_BYTES];
    stream.read_exact(&mut hello)?;
    if &hello[..8] != GREETING {
        return Err(bad("not an mpipemoe rank".into()));
    }
    let word = |i: usize| u32::from_le_bytes(hello[i..i + 4].try_into().expect("4 bytes")) as usize;
    let (rank, their_world) = (word(8), word(12));
    if their_world != world || rank == 0 || rank >= world || served.contains(&rank) {
        return Err(bad(format!(
            "rank {rank} of {their_world} does not fit a world of {world}"
        )));
    }
    stream.write_all(id)?;
    stream.flush()?;
    Ok(rank)
}

/// A joining rank's side: connects to rank 0 at `addr`, retrying until `timeout`, and returns
/// the id.
pub fn fetch_id(addr: &str, rank: usize, world: usize, timeout: Duration) -> Result<[u8; ID_BYTES]> {
    if rank == 0 || rank >= world {
        return Err(init_err(
            rank,
            format!("rank {rank} cannot join a world of {world} as a client"),
        ));
    }
    let start = Instant::now();
    let mut last_error = String::from("no attempt");
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(init_err(
                rank,
                format!("rank 0 at {addr} did not hand out the NCCL id within {timeout:?} (last error: {last_error})"),
            ));
        }
        match try_fetch(addr, rank, world, left) {
            Ok(id) => return Ok(id),
            Err(e) => {
                last_error = e.to_string();
                std::thread::sleep(POLL.min(left));
            }
        }
    }
}

/// One attempt at every address `addr` resolves to, in turn (a name may resolve to an
/// address where nothing listens first, IPv6 before IPv4, say), until one hands out the id.
fn try_fetch(addr: &str, rank: usize, world: usize, timeout: Duration) -> std::io::Result<[u8; ID_BYTES]> {
    let targets: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    try_fetch_from(&targets, rank, world, timeout).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{addr} resolves to nothing"),
        ),
        _ => e,
    })
}

/// One attempt at each of `targets` in turn (a joining rank's fetch of the NCCL id over
/// addresses already resolved): the id from the first that answers, else the last error.
pub fn try_fetch_from(
    targets: &[SocketAddr],
    rank: usize,
    world: usize,
    timeout: Duration,
) -> std::io::Result<[u8; ID_BYTES]> {
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
    for target in targets {
        match fetch_at(target, rank, world, timeout) {
            Ok(id) => return Ok(id),
            Err(e) => last = std::io::Error::new(e.kind(), format!("{target}: {e}")),
        }
    }
    Err(last)
}

fn fetch_at(
    target: &SocketAddr,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> std::io::Result<[u8; ID_BYTES]> {
    let mut stream = TcpStream::connect_timeout(target, timeout.min(Duration::from_secs(2)))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut hello = [0u8; HELLO_BYTES];
    hello[..8].copy_from_slice(GREETING);
    hello[8..12].copy_from_slice(&(rank as u32).to_le_bytes());
    hello[12..].copy_from_slice(&(world as u32).to_le_bytes());
    stream.write_all(&hello)?;
    let mut id = [0u8; ID_BYTES];
    stream.read_exact(&mut id)?;
    Ok(id)
}

/// The environment variable that names the port of the crate's own NCCL-id rendezvous.
pub const RENDEZVOUS_PORT_VAR: &str = "MPIPEMOE_RENDEZVOUS_PORT";

/// How far above `MASTER_PORT` the rendezvous listens when [`RENDEZVOUS_PORT_VAR`] is unset.
///
/// Not `MASTER_PORT` itself: under torchrun, the elastic agent's own TCPStore already listens
/// there (and the workers' `init_process_group` reuses it), so rank 0 could not bind it and
/// the other ranks would greet torchrun's store instead of rank 0.
pub const RENDEZVOUS_PORT_OFFSET: u16 = 1;

/// A port number from environment variable `name`: 1 to 65535, or an error naming it.
fn env_port(name: &str, value: &str) -> Result<u16> {
    value
        .trim()
        .parse::<u16>()
        .ok()
        .filter(|&p| p != 0)
        .ok_or_else(|| MoeError::Backend(format!("{name}={value:?} is not a port number (1 to 65535)")))
}

/// A count from environment variable `name`, or `default` when it is unset.
pub fn env_usize(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|_| MoeError::Backend(format!("environment variable {name}={v:?} is not a number"))),
        Err(_) => Ok(default),
    }
}

/// Where rank 0 hands out the NCCL id: `MASTER_ADDR` (default `127.0.0.1`, as torchrun's for
/// one node) at port [`RENDEZVOUS_PORT_VAR`] if set, else `MASTER_PORT` (default 29500) plus
/// [`RENDEZVOUS_PORT_OFFSET`]. Every rank must see the same values.
///
/// # Errors
/// A variable that is not a port number, or a `MASTER_PORT` with no port above it, named.
pub fn rendezvous_addr_from_env() -> Result<String> {
    let host = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    let port = match std::env::var(RENDEZVOUS_PORT_VAR) {
        Ok(p) => env_port(RENDEZVOUS_PORT_VAR, &p)?,
        Err(_) => {
            let master = match std::env::var("MASTER_PORT") {
                Ok(p) => env_port("MASTER_PORT", &p)?,
                Err(_) => 29500,
            };
            master.checked_add(RENDEZVOUS_PORT_OFFSET).ok_or_else(|| {
                MoeError::Backend(format!(
                    "MASTER_PORT={master} leaves no port for the NCCL-id rendezvous at MASTER_PORT + \
                     {RENDEZVOUS_PORT_OFFSET}: set {RENDEZVOUS_PORT_VAR}"
                ))
            })?
        }
    };
    // An IPv6 literal needs brackets to take a port.
    Ok(match host.contains(':') && !host.starts_with('[') {
        true => format!("[{host}]:{port}"),
        false => format!("{host}:{port}"),
    })
}

/// This process's rank and the world size from torchrun's `RANK` and `WORLD_SIZE` (defaults
/// 0 and 1).
///
/// # Errors
/// A value that is not a number, a world of 0, or a rank not below the world, named.
pub fn rank_from_env() -> Result<(usize, usize)> {
    let rank = env_usize("RANK", 0)?;
    let world = env_usize("WORLD_SIZE", 1)?;
    if world == 0 || rank >= world {
        return Err(MoeError::Backend(format!(
            "RANK {rank} is not below WORLD_SIZE {world}"
        )));
    }
    Ok((rank, world))
}

/// The whole rendezvous of one process as the environment describes it ([`rank_from_env`],
/// [`rendezvous_addr_from_env`]): rank 0 makes the id with `make_id`, listens and hands it to
/// every other rank; the others fetch it. Returns `(rank, world, id)`. A world of one needs
/// no rendezvous.
///
/// # Errors
/// A bad variable, a port rank 0 cannot bind, or a rank that does not arrive within
/// `timeout`.
pub fn rendezvous_from_env(
    make_id: impl FnOnce() -> Result<[u8; ID_BYTES]>,
    timeout: Duration,
) -> Result<(usize, usize, [u8; ID_BYTES])> {
    let (rank, world) = rank_from_env()?;
    if world == 1 {
        return Ok((rank, world, make_id()?));
    }
    let addr = rendezvous_addr_from_env()?;
    let id = if rank == 0 {
        let id = make_id()?;
        // Every interface, not `MASTER_ADDR`'s: see the module's documentation.
        let port = addr
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .ok_or_else(|| init_err(rank, format!("no port in the rendezvous address {addr}")))?;
        let listeners = listen_everywhere(port)?;
        // Every rank has the id before rank 0 joins NCCL: the others wait inside NCCL's
        // initialisation for it, and a rank that never came is an error here rather than a
        // hang inside NCCL.
        serve_id(&listeners, world, &id, timeout)?;
        id
    } else {
        fetch_id(&addr, rank, world, timeout)?
    };
    Ok((rank, world, id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> [u8; ID_BYTES] {
        std::array::from_fn(|i| (i * 7 + 3) as u8)
    }

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let world = 4;
        let got = std::thread::scope(|s| {
            let server = s.spawn(|| {
                serve_id(
                    std::slice::from_ref(&listener),
                    world,
                    &id(),
                    Duration::from_secs(20),
                )
            });
            let clients: Vec<_> = (1..world)
                .map(|rank| {
                    let addr = addr.clone();
                    s.spawn(move || fetch_id(&addr, rank, world, Duration::from_secs(20)))
                })
                .collect();
            server.join().unwrap().unwrap();
            clients
                .into_iter()
                .map(|c| c.join().unwrap().unwrap())
                .collect::<Vec<_>>()
        });
        assert_eq!(got, vec![id(); world - 1]);
    }

    #[test]
    fn a_stranger_does_not_count_and_a_late_rank_is_named() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let err = std::thread::scope(|s| {
            let server = s.spawn(|| {
                serve_id(
                    std::slice::from_ref(&listener),
                    3,
                    &id(),
                    Duration::from_millis(1500),
                )
            });
            // Garbage, a rank of another world, and rank 1 properly: rank 2 never comes.
            let mut junk = TcpStream::connect(addr).unwrap();
            junk.write_all(&[0xff; 40]).unwrap();
            let mut wrong = [0u8; HELLO_BYTES];
            wrong[..8].copy_from_slice(GREETING);
            wrong[8..12].copy_from_slice(&2u32.to_le_bytes());
            wrong[12..].copy_from_slice(&8u32.to_le_bytes());
            TcpStream::connect(addr).unwrap().write_all(&wrong).unwrap();
            let one = fetch_id(&addr.to_string(), 1, 3, Duration::from_secs(5)).unwrap();
            assert_eq!(one, id());
            server.join().unwrap().unwrap_err()
        });
        let text = err.to_string();
        assert!(text.contains("[2]") && text.contains("did not join"), "{text}");
    }

    /// Rank 0 listens on every interface, so a rank that reaches this machine by any of its
    /// addresses gets the id: loopback in both families and, where the machine has one, an
    /// address of another interface (the case where `MASTER_ADDR` resolves to loopback on
    /// rank 0's own node but to its network address everywhere else).
    #[test]
    fn rank_zero_answers_on_every_interface() {
        let listeners = listen_everywhere(0).unwrap();
        let port = listeners[0].local_addr().unwrap().port();
        let mut targets: Vec<SocketAddr> = vec![([127, 0, 0, 1], port).into()];
        if std::net::TcpListener::bind("[::1]:0").is_ok() {
            targets.push((std::net::Ipv6Addr::LOCALHOST, port).into());
        }
        // This machine's address on its default route, if it has one (no packet is sent).
        let probe = std::net::UdpSocket::bind("0.0.0.0:0").and_then(|u| {
            u.connect("192.0.2.1:9")?;
            u.local_addr()
        });
        if let Some(own) = probe
            .ok()
            .map(|a| a.ip())
            .filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
        {
            targets.push((own, port).into());
        }
        let world = targets.len() + 1;
        std::thread::scope(|s| {
            let server = s.spawn(|| serve_id(&listeners, world, &id(), Duration::from_secs(20)));
            for (i, target) in targets.iter().enumerate() {
                let got = try_fetch_from(std::slice::from_ref(target), i + 1, world, Duration::from_secs(5))
                    .unwrap_or_else(|e| panic!("{target}: {e}"));
                assert_eq!(got, id(), "{target}");
            }
            server.join().unwrap().unwrap();
        });
    }

    /// A client tries every address a name resolves to: a first address where nothing
    /// listens (as `localhost` → `::1` where rank 0 listens on IPv4 only) does not end it.
    #[test]
    fn a_client_tries_every_address() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let live = listener.local_addr().unwrap();
        let dead: SocketAddr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        std::thread::scope(|s| {
            let server =
                s.spawn(|| serve_id(std::slice::from_ref(&listener), 2, &id(), Duration::from_secs(20)));
            let got = try_fetch_from(&[dead, live], 1, 2, Duration::from_secs(5)).unwrap();
            assert_eq!(got, id());
            server.join().unwrap().unwrap();
        });
        // Only dead addresses: the error names the last one tried.
        let err = try_fetch_from(&[dead], 1, 2, Duration::from_millis(300)).unwrap_err();
        assert!(err.to_string().contains(&dead.to_string()), "{err}");
    }

    #[test]
    fn a_rank_without_rank_zero_times_out_with_the_address() {
        // A port nobody listens on: bind one, learn its number, close it.
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .to_string();
        let err = fetch_id(&addr, 1, 2, Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(err.contains(&addr) && err.contains("did not hand out"), "{err}");
        assert!(fetch_id(&addr, 0, 2, Duration::from_millis(10)).is_err());
        assert!(fetch_id(&addr, 2, 2, Duration::from_millis(10)).is_err());
    }
}
