//! On Linux, a watcher of the command's process group: should `distlock` die without seeing
//! the command's end (SIGKILL, a crash), it kills what is left of the group. The kernel's
//! parent-death signal reaches the command itself only, not what it started (a shell's
//! pipeline, a program's workers), which would otherwise run on while the lease runs out.
//!
//! The watcher is `distlock` itself, started as `distlock __watch-group GROUP` in a process
//! group of its own (so that no signal meant for the command reaches it). It reads one end
//! of a pipe whose other end only `distlock` holds: a line means the command's end was seen
//! to, and the watcher leaves; the end of the stream means `distlock` is gone, and the
//! watcher sends SIGKILL to the group.

use std::io::{self, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitCode, Stdio};

/// The argument that makes `distlock` a watcher.
pub(crate) const ARG: &str = "__watch-group";

/// A watcher of one process group, until [`disarm`](Self::disarm)ed or dropped.
#[derive(Debug)]
pub(crate) struct GroupWatch {
    /// `distlock`'s end of the pipe (close-on-exec: no command inherits it).
    writer: Option<io::PipeWriter>,
    watcher: Child,
}

impl GroupWatch {
    /// Starts watching the process group `group`.
    pub(crate) fn start(group: u32) -> io::Result<Self> {
        let (reader, writer) = io::pipe()?;
        let watcher = Command::new(std::env::current_exe()?)
            .arg(ARG)
            .arg(group.to_string())
            .stdin(reader)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()?;
        Ok(Self {
            writer: Some(writer),
            watcher,
        })
    }
}

impl Drop for GroupWatch {
    /// The command's end was seen to: the watcher leaves the group alone.
    fn drop(&mut self) {
        if let Some(mut writer) = self.writer.take() {
            let _ = writer.write_all(b"\n");
        }
        let _ = self.watcher.wait();
    }
}

/// The watcher's own work, `distlock __watch-group GROUP`: waits for its line or the end of
/// its input; at the end, SIGKILL to `GROUP`.
pub(crate) fn watch(group: &str) -> ExitCode {
    let Ok(group) = group.parse::<i32>() else {
        return ExitCode::from(crate::exit::USAGE);
    };
    let mut byte = [0u8; 1];
    loop {
        match io::stdin().read(&mut byte) {
            Ok(0) => break,
            Ok(_) => return ExitCode::SUCCESS,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    use nix::sys::signal::{Signal, killpg};
    let _ = killpg(nix::unistd::Pid::from_raw(group), Signal::SIGKILL);
    ExitCode::SUCCESS
}
