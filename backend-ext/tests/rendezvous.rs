//! The NCCL-id rendezvous as torchrun runs it: separate processes, each with its own `RANK`,
//! `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`, while torchrun's own agent store already
//! listens on `MASTER_PORT` (here a fake agent: a listener that accepts and answers nothing,
//! as a TCPStore does to a greeting it does not understand). No CUDA or NCCL needed: the id is
//! a fixed pattern.
//!
//! The two ranks are this test binary run again as child processes (`child_rank` below does
//! the work where `MPIPEMOE_RENDEZVOUS_CHILD` is set and nothing otherwise).

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output};
use std::time::Duration;

use mpipemoe_cuda::bootstrap::{rendezvous_from_env, ID_BYTES, RENDEZVOUS_PORT_VAR};

const CHILD: &str = "MPIPEMOE_RENDEZVOUS_CHILD";
/// How long a child sleeps before its rendezvous, in milliseconds.
const DELAY: &str = "MPIPEMOE_RENDEZVOUS_CHILD_DELAY_MS";
/// A child's rendezvous timeout, in milliseconds (default 20 s).
const TIMEOUT: &str = "MPIPEMOE_RENDEZVOUS_CHILD_TIMEOUT_MS";

fn pattern() -> [u8; ID_BYTES] {
    std::array::from_fn(|i| (i * 13 + 5) as u8)
}

/// One rank's side when run as a child: the rendezvous from the environment, then the id it
/// ended with on stdout as hex.
#[test]
fn child_rank() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let ms = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    // A rank that comes late: torchrun starts processes about together, a hand-started node
    // seconds or minutes after the others.
    std::thread::sleep(Duration::from_millis(ms(DELAY, 0)));
    let got = rendezvous_from_env(|| Ok(pattern()), Duration::from_millis(ms(TIMEOUT, 20_000)));
    match got {
        Ok((rank, world, id)) => {
            let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
            println!("RANK {rank} OF {world} ID {hex}");
        }
        Err(e) => {
            println!("ERROR {e}");
            std::process::exit(3);
        }
    }
}

/// A fake torchrun agent on a free port: accepts connections and holds them without a word.
fn fake_agent() -> (TcpListener, u16) {
    let agent = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = agent.local_addr().unwrap().port();
    agent.set_nonblocking(true).unwrap();
    (agent, port)
}

/// A port nobody listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn(rank: usize, world: usize, master_port: u16, rendezvous_port: Option<u16>) -> std::process::Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "child_rank", "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", master_port.to_string())
        .env_remove(RENDEZVOUS_PORT_VAR)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    if let Some(p) = rendezvous_port {
        cmd.env(RENDEZVOUS_PORT_VAR, p.to_string());
    }
    cmd.spawn().unwrap()
}

/// Runs ranks `0..world` as processes and returns their outputs, while the fake agent
/// accepts (and keeps) whatever connects to it.
fn bootstrap(
    world: usize,
    agent: &TcpListener,
    master_port: u16,
    rendezvous_port: Option<u16>,
) -> Vec<Output> {
    let children: Vec<_> = (0..world)
        .map(|rank| spawn(rank, world, master_port, rendezvous_port))
        .collect();
    let mut held: Vec<TcpStream> = Vec::new();
    let mut greeted = Vec::new();
    let outputs: Vec<Output> = std::thread::scope(|s| {
        let waits: Vec<_> = children
            .into_iter()
            .map(|c| s.spawn(|| c.wait_with_output().unwrap()))
            .collect();
        while waits.iter().any(|w| !w.is_finished()) {
            if let Ok((mut stream, _)) = agent.accept() {
                stream.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
                let mut buf = [0u8; 64];
                greeted.push(stream.read(&mut buf).unwrap_or(0));
                held.push(stream);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        waits.into_iter().map(|w| w.join().unwrap()).collect()
    });
    assert!(
        greeted.iter().all(|&n| n == 0),
        "a rank greeted torchrun's agent on MASTER_PORT ({} connections)",
        greeted.len()
    );
    outputs
}

fn expect_id(outputs: &[Output]) {
    let hex: String = pattern().iter().map(|b| format!("{b:02x}")).collect();
    for (rank, out) in outputs.iter().enumerate() {
        let text = String::from_utf8_lossy(&out.stdout);
        let want = format!("RANK {rank} OF {} ID {hex}", outputs.len());
        assert!(
            out.status.success() && text.contains(&want),
            "rank {rank} ({}): {text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// With `MASTER_PORT` held by the agent and no port of the crate's own set, the ranks meet at
/// `MASTER_PORT + 1`; a port is picked whose next port is free.
#[test]
fn ranks_meet_beside_torchruns_agent_on_master_port_plus_one() {
    let (agent, port) = loop {
        let (agent, port) = fake_agent();
        if port < u16::MAX && TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            break (agent, port);
        }
    };
    expect_id(&bootstrap(2, &agent, port, None));
}

/// `MPIPEMOE_RENDEZVOUS_PORT` names the port outright.
#[test]
fn ranks_meet_on_the_named_rendezvous_port() {
    let (agent, port) = fake_agent();
    expect_id(&bootstrap(2, &agent, port, Some(free_port())));
}

/// A rendezvous port that is not a port is an error naming the variable, on every rank.
#[test]
fn a_bad_rendezvous_port_is_named() {
    let (agent, port) = fake_agent();
    drop(agent);
    for out in (0..2).map(|rank| {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "child_rank", "--nocapture"])
            .env(CHILD, "1")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_PORT", port.to_string())
            .env(RENDEZVOUS_PORT_VAR, "70000");
        cmd.output().unwrap()
    }) {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            !out.status.success() && text.contains(RENDEZVOUS_PORT_VAR),
            "{text}"
        );
    }
}

/// One child rank with its own `MASTER_ADDR`, start delay and timeout, rendezvousing on
/// `port` (no torchrun agent involved).
fn spawn_at(
    rank: usize,
    world: usize,
    master_addr: &str,
    port: u16,
    delay_ms: u64,
    timeout_ms: u64,
) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_rank", "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", master_addr)
        .env("MASTER_PORT", "29500")
        .env(RENDEZVOUS_PORT_VAR, port.to_string())
        .env(DELAY, delay_ms.to_string())
        .env(TIMEOUT, timeout_ms.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// This machine's address on its default route, if it has one that is not loopback.
fn own_address() -> Option<std::net::IpAddr> {
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    // Connecting a UDP socket sends nothing; it only picks the route and its source address.
    probe.connect("192.0.2.1:9").ok()?;
    let ip = probe.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

/// Ranks that arrive seconds apart, rank 0 last, all get the id: the others retry until
/// rank 0 listens. `MASTER_ADDR` is a name (`localhost`), which may resolve to `::1` before
/// `127.0.0.1`: every address is tried.
#[test]
fn ranks_arriving_seconds_apart_meet() {
    let port = free_port();
    let children: Vec<_> = [(0, 2500), (1, 0), (2, 1200)]
        .into_iter()
        .map(|(rank, delay)| spawn_at(rank, 3, "localhost", port, delay, 20_000))
        .collect();
    let outputs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    expect_id(&outputs);
}

/// `ranks` of a world of three, started together on loopback with a 2 s bound; the others
/// never start.
fn ranks_of_three(ranks: &[usize], port: u16) -> Vec<Output> {
    let children: Vec<_> = ranks
        .iter()
        .map(|&rank| spawn_at(rank, 3, "127.0.0.1", port, 0, 2_000))
        .collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

/// A rank that never comes (it died before the rendezvous) is named by rank 0 within the
/// bound; and when rank 0 is the one that died, every other rank fails within the bound
/// naming rank 0's address, instead of waiting for ever.
#[test]
fn a_rank_that_died_is_named_within_the_bound() {
    let port = free_port();
    let start = std::time::Instant::now();
    // World of 3; rank 2 never starts.
    let outputs = ranks_of_three(&[0, 1], port);
    let zero = String::from_utf8_lossy(&outputs[0].stdout);
    assert!(
        !outputs[0].status.success() && zero.contains("[2]") && zero.contains("did not join"),
        "{zero}"
    );
    // Rank 1 got its id before rank 0 gave up.
    assert!(
        outputs[1].status.success(),
        "{}",
        String::from_utf8_lossy(&outputs[1].stdout)
    );
    // Rank 0 never starts: ranks 1 and 2 fail naming its address.
    let port = free_port();
    let outputs = ranks_of_three(&[1, 2], port);
    for out in &outputs {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            !out.status.success()
                && text.contains(&format!("127.0.0.1:{port}"))
                && text.contains("did not hand out"),
            "{text}"
        );
    }
    // Both worlds ended within their 2 s bounds plus process start-up.
    assert!(start.elapsed() < Duration::from_secs(30), "{:?}", start.elapsed());
}

/// Debian and Ubuntu resolve a node's own hostname to `127.0.1.1`: rank 0's `MASTER_ADDR`
/// is then a loopback address, while the other nodes reach it by its network address.
/// Rank 0 listens on every interface, so a rank that comes by the network address still
/// gets the id (a listener bound to `MASTER_ADDR` would be out of its reach).
#[test]
fn rank_zero_with_a_loopback_master_addr_is_reached_by_its_network_address() {
    let Some(own) = own_address() else {
        eprintln!("skipped: this machine has no address but loopback");
        return;
    };
    let port = free_port();
    let zero = spawn_at(0, 2, "127.0.0.1", port, 0, 20_000);
    let one = spawn_at(1, 2, &own.to_string(), port, 0, 20_000);
    let outputs = vec![zero.wait_with_output().unwrap(), one.wait_with_output().unwrap()];
    expect_id(&outputs);
}
