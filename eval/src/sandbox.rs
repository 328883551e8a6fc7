//! Running code a model wrote: each program in a throwaway sandbox, so that a hanging or
//! hostile answer costs one failed problem and nothing else.
//!
//! The program runs under `unshare` in its own PID, mount and network namespaces: no network
//! device but a loopback that is down; every mount read-only except a fresh size-bounded
//! tmpfs at `/tmp`, its working folder (and empty ones over `/dev/shm` and `/var/tmp`); a
//! user id no other process has, so the process limit counts its own processes only; and
//! `prlimit` bounds on address space, CPU seconds, processes, file size and open files. A
//! wall clock kills it; killing `unshare` kills the namespace's first process, and with it
//! every process left in the namespace (a fork bomb included).
//!
//! It needs root (namespaces and a throwaway user id) and util-linux's `unshare`, `setpriv`
//! and `prlimit`; [`Sandbox::new`] says which is missing.

use std::{
    io::{Read, Write},
    path::PathBuf,
    process::{Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};

/// What one program may use.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SandboxLimits {
    pub wall_seconds: f64,
    pub cpu_seconds: u64,
    /// Address space.
    pub memory_bytes: u64,
    pub processes: u64,
    /// The largest file it may write, and the size of its tmpfs.
    pub file_bytes: u64,
    pub tmpfs_megabytes: u64,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        Self {
            wall_seconds: 15.0,
            cpu_seconds: 10,
            memory_bytes: 1 << 30,
            processes: 16,
            file_bytes: 16 << 20,
            tmpfs_megabytes: 64,
        }
    }
}

/// How a program ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunOutcome {
    /// Exited with status 0 within the limits.
    pub passed: bool,
    pub timed_out: bool,
    /// Exit status (`None`: killed by a signal).
    pub exit_code: Option<i32>,
    /// The last bytes it wrote to stderr (for reports).
    pub stderr_tail: String,
    pub seconds: f64,
    /// The user id it ran as (no other process had it).
    #[serde(skip)]
    pub sandbox_uid: u32,
}

pub struct Sandbox {
    python: PathBuf,
    limits: SandboxLimits,
}

/// Each run gets a user id of its own, from a range no account uses.
static NEXT_UID: AtomicU32 = AtomicU32::new(0);
const UID_BASE: u32 = 1_900_000_000;

/// Output kept from a program's stderr; more is read and dropped, so a program printing
/// without end cannot fill memory.
const STDERR_TAIL: usize = 2048;

/// The script run as the namespaces' first process: read-only mounts, fresh tmpfs folders,
/// the program from stdin into /tmp, then the interpreter as the throwaway user with limits.
const SETUP: &str = r#"set -e
mount --make-rprivate /
for m in $(awk '{print $5}' /proc/self/mountinfo | sort -u); do
  case "$m" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/pts|/dev/mqueue) continue;; esac
  mount -o remount,bind,ro "$m" 2>/dev/null || true
done
mount -t tmpfs -o "size=${TMPFS_MB}m,mode=1777" sandbox /tmp
mount -t tmpfs -o size=1m,mode=1777 sandbox /dev/shm 2>/dev/null || true
mount -t tmpfs -o size=1m,mode=1777 sandbox /var/tmp 2>/dev/null || true
cd /tmp
cat > program.py
chmod 644 program.py
exec setpriv --reuid="$SANDBOX_UID" --regid="$SANDBOX_UID" --clear-groups --no-new-privs \
  env -i HOME=/tmp TMPDIR=/tmp PATH=/usr/bin:/bin LANG=C.UTF-8 \
  prlimit --as="$LIMIT_AS" --cpu="$LIMIT_CPU" --nproc="$LIMIT_NPROC" --fsize="$LIMIT_FSIZE" --nofile=64 --core=0 -- \
  "$PYTHON" -I -B program.py
"#;

impl Sandbox {
    /// A sandbox running programs with `python` (an interpreter every user may run, e.g.
    /// `/usr/bin/python3`), after checking that it can run here.
    pub fn new(python: impl Into<PathBuf>, limits: SandboxLimits) -> Result<Self> {
        let python = python.into();
        ensure!(
            nix_is_root(),
            "running model-written code needs root: the sandbox gives each program its own namespaces and a user id of its own (code tasks cannot run as this user)"
        );
        for tool in ["unshare", "setpriv", "prlimit", "mount"] {
            ensure!(
                ["/usr/bin", "/bin", "/usr/sbin", "/sbin"].iter().any(|d| std::path::Path::new(d).join(tool).is_file()),
                "the sandbox needs util-linux's `{tool}` (apt-get install util-linux mount)"
            );
        }
        let sandbox = Self { python, limits };
        let check = sandbox.run("print('ok')")?;
        if !check.passed {
            bail!(
                "the sandbox cannot run {}: {} (pass an interpreter every user may run, e.g. --sandbox-python /usr/bin/python3)",
                sandbox.python.display(),
                check.stderr_tail.trim()
            );
        }
        Ok(sandbox)
    }

    /// The interpreter named by `$VERDICT_SANDBOX_PYTHON`, else `/usr/bin/python3`.
    pub fn default_python() -> PathBuf {
        std::env::var_os("VERDICT_SANDBOX_PYTHON").map_or_else(|| PathBuf::from("/usr/bin/python3"), PathBuf::from)
    }

    pub fn limits(&self) -> &SandboxLimits {
        &self.limits
    }

    /// Run one Python program to its end or its limits. An error means the sandbox itself
    /// could not run; a program that fails in any way is an outcome that did not pass.
    pub fn run(&self, program: &str) -> Result<RunOutcome> {
        let uid = UID_BASE + NEXT_UID.fetch_add(1, Ordering::Relaxed) % 1_000_000;
        let l = &self.limits;
        let started = Instant::now();
        let mut child = Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "--net", "--ipc", "--uts", "--", "sh", "-c", SETUP])
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("SANDBOX_UID", uid.to_string())
            .env("PYTHON", &self.python)
            .env("TMPFS_MB", l.tmpfs_megabytes.to_string())
            .env("LIMIT_AS", l.memory_bytes.to_string())
            .env("LIMIT_CPU", l.cpu_seconds.to_string())
            .env("LIMIT_NPROC", l.processes.to_string())
            .env("LIMIT_FSIZE", l.file_bytes.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot start `unshare` for the sandbox")?;
        let mut stdin = child.stdin.take().unwrap();
        let program = program.as_bytes().to_vec();
        let writer = std::thread::spawn(move || {
            // A program that never reads is fine: the script reads it all first.
            let _ = stdin.write_all(&program);
        });
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let drain_stdout = std::thread::spawn(move || tail_of(stdout, 0));
        let drain_stderr = std::thread::spawn(move || tail_of(stderr, STDERR_TAIL));
        let wall = Duration::from_secs_f64(l.wall_seconds);
        let mut timed_out = false;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if started.elapsed() >= wall {
                timed_out = true;
                // The namespace's first process is unshare's child; when it dies, the kernel
                // kills every other process in the namespace. (unshare's --kill-child cannot
                // do it: changing user ids clears a parent-death signal.)
                for pid in children_of(child.id()) {
                    kill(pid);
                }
                let _ = child.kill();
                break child.wait()?;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        // Whatever is left of the run (nothing, once the namespace is gone) holds its uid.
        kill_user(uid);
        let _ = writer.join();
        let _ = drain_stdout.join();
        let stderr_tail = drain_stderr.join().unwrap_or_default();
        Ok(RunOutcome {
            passed: !timed_out && status.success(),
            timed_out,
            exit_code: status.code(),
            stderr_tail,
            seconds: started.elapsed().as_secs_f64(),
            sandbox_uid: uid,
        })
    }
}

/// Read `reader` to its end, keeping only its last `keep` bytes as text.
fn tail_of(mut reader: impl Read, keep: usize) -> String {
    let mut tail: Vec<u8> = Vec::new();
    let mut buffer = [0u8; 8192];
    while let Ok(n) = reader.read(&mut buffer) {
        if n == 0 {
            break;
        }
        if keep > 0 {
            tail.extend_from_slice(&buffer[..n]);
            if tail.len() > keep {
                tail.drain(..tail.len() - keep);
            }
        }
    }
    String::from_utf8_lossy(&tail).into_owned()
}

/// The children of process `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn kill(pid: u32) {
    // SAFETY: kill(2) with a pid read from /proc and SIGKILL touches no memory of ours.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
}

/// The real user id of process `pid`, unless it has exited (a zombie holds nothing).
fn uid_of(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| status.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().nth(1).map(str::to_string));
    if field("State:").is_some_and(|s| s == "Z" || s == "X") {
        return None;
    }
    field("Uid:")?.parse().ok()
}

/// Every process running as `uid`, until none is left (a fork bomb's children included).
fn kill_user(uid: u32) {
    for _ in 0..100 {
        let pids: Vec<u32> = std::fs::read_dir("/proc")
            .map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
            .unwrap_or_default();
        let theirs: Vec<u32> = pids.into_iter().filter(|&p| uid_of(p) == Some(uid)).collect();
        if theirs.is_empty() {
            return;
        }
        theirs.into_iter().for_each(kill);
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn nix_is_root() -> bool {
    // The real user id, from /proc (no libc binding needed for one number).
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).and_then(|l| l.split_whitespace().nth(1)).map(|u| u == "0"))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sandbox with short limits.
    fn sandbox() -> Sandbox {
        Sandbox::new(
            Sandbox::default_python(),
            SandboxLimits {
                wall_seconds: 5.0,
                cpu_seconds: 3,
                memory_bytes: 512 << 20,
                processes: 8,
                ..SandboxLimits::default()
            },
        )
        .expect("the sandbox runs here (tests run as root, as CI does)")
    }

    #[test]
    fn a_passing_program_passes_and_a_failing_one_fails() {
        let s = sandbox();
        assert!(s.run("assert sum([1, 2]) == 3").unwrap().passed);
        let failed = s.run("def f():\n    return 1\nassert f() == 2, 'wrong answer'").unwrap();
        assert!(!failed.passed && !failed.timed_out);
        assert_eq!(failed.exit_code, Some(1));
        assert!(failed.stderr_tail.contains("wrong answer"), "{}", failed.stderr_tail);
    }

    #[test]
    fn an_infinite_loop_is_stopped() {
        let s = sandbox();
        let out = s.run("while True:\n    pass").unwrap();
        assert!(!out.passed);
        // The CPU limit (3 s) or the wall clock (5 s) ends it.
        assert!(out.seconds < 6.0, "{out:?}");
    }

    #[test]
    fn a_sleeping_program_is_killed_at_the_wall_clock() {
        let s = sandbox();
        let out = s.run("import time\ntime.sleep(60)").unwrap();
        assert!(out.timed_out && !out.passed && out.seconds < 6.0, "{out:?}");
    }

    #[test]
    fn a_fork_bomb_is_contained_and_cleaned_up() {
        let s = sandbox();
        let out = s.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass").unwrap();
        assert!(!out.passed, "{out:?}");
        // Nothing of it outlives the run: no process of a sandbox user id is left.
        std::thread::sleep(Duration::from_millis(200));
        let left = std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|&pid| uid_of(pid) == Some(out.sandbox_uid))
            .count();
        assert_eq!(left, 0, "sandbox processes left running");
    }

    #[test]
    fn a_large_allocation_fails() {
        let s = sandbox();
        let out = s.run("x = bytearray(2 * 1024 ** 3)\nprint(len(x))").unwrap();
        assert!(!out.passed && out.stderr_tail.contains("MemoryError"), "{out:?}");
    }

    #[test]
    fn the_network_is_unreachable() {
        let s = sandbox();
        // A listener on this machine's loopback: outside the sandbox a connect succeeds.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let out = s.run(&format!("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")).unwrap();
        assert!(!out.passed && out.stderr_tail.contains("Error"), "{out:?}");
        assert!(listener.accept().is_err(), "the sandboxed program reached the listener");
    }

    #[test]
    fn writing_outside_the_temporary_folder_is_refused() {
        let s = sandbox();
        let marker = std::env::temp_dir().join(format!("verdict-sandbox-escape-{}", std::process::id()));
        let outside = std::env::current_dir().unwrap().join(format!("verdict-sandbox-escape-{}", std::process::id()));
        for path in [&marker, &outside] {
            let program = format!("open({:?}, 'w').write('escaped')", path.display().to_string());
            let out = s.run(&program).unwrap();
            assert!(!out.passed || !path.exists(), "{out:?}");
            assert!(!path.exists(), "{} was written", path.display());
        }
        // Its own folder is writable.
        assert!(s.run("open('scratch.txt', 'w').write('x')\nassert open('/tmp/scratch.txt').read() == 'x'").unwrap().passed);
    }

    #[test]
    fn endless_output_is_read_and_dropped() {
        let s = sandbox();
        let out = s.run("import sys\nfor _ in range(200000):\n    sys.stdout.write('x' * 100)\n    sys.stderr.write('y' * 100)").unwrap();
        assert!(out.stderr_tail.len() <= STDERR_TAIL, "{}", out.stderr_tail.len());
    }
}
