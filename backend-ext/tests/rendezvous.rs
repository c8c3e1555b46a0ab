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
    let got = rendezvous_from_env(|| Ok(pattern()), Duration::from_secs(20));
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
