//! The floor's tunnel relay: leasegate's src/proxy/splice.rs, copied with its byte counters,
//! lease token and idle timeout taken out (what is left is the socket work). Keep the two in
//! step: a change there that moves bytes differently belongs here too.
//!
//! Invariant: a direction's pipe is filled only when empty and drained whole before the next
//! fill, so a would-block always names the socket waited on, never the pipe; a source's end of
//! stream shuts the other socket's write side once everything before it is written. A
//! direction that cannot splice (no pipe, or a socket that refuses splice before its first
//! byte) copies through a buffer instead.

use nix::errno::Errno;
use nix::fcntl::{splice, FcntlArg, OFlag, SpliceFFlags};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Bytes per pipe, as leasegate's (a larger pipe than the default 64 KiB; refused: the default).
const PIPE_BYTES: usize = 256 * 1024;

/// The buffer of a direction that cannot splice (leasegate's `RELAY_BUFFER`).
const RELAY_BUFFER: usize = 32 * 1024;

/// Moves bytes both ways between two TCP sockets until both sides have ended or either fails.
pub async fn relay(client: TcpStream, upstream: TcpStream) {
    let _ = tokio::try_join!(pump(&client, &upstream), pump(&upstream, &client));
    // The client hears the end at once.
    let _ = shut_write(&client);
}

/// What a direction moves its bytes through.
enum Via {
    Pipe { read: OwnedFd, write: OwnedFd },
    Buffer(Box<[u8]>),
}

impl Via {
    fn new() -> Via {
        match nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC) {
            Ok((read, write)) => {
                let _ = nix::fcntl::fcntl(&write, FcntlArg::F_SETPIPE_SZ(PIPE_BYTES as i32));
                Via::Pipe { read, write }
            }
            Err(_) => Via::buffer(),
        }
    }

    fn buffer() -> Via {
        Via::Buffer(vec![0; RELAY_BUFFER].into_boxed_slice())
    }

    /// Takes what `src` has (0 at its end of stream); called only when empty.
    fn fill(&mut self, src: &TcpStream) -> io::Result<usize> {
        match self {
            Via::Pipe { write, .. } => Ok(splice(
                src.as_fd(),
                None,
                write.as_fd(),
                None,
                PIPE_BYTES,
                SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK,
            )?),
            Via::Buffer(buf) => src.try_read(buf),
        }
    }

    /// Writes some of the `len` bytes held from offset `at` to `dst`.
    fn drain(&mut self, dst: &TcpStream, at: usize, len: usize) -> io::Result<usize> {
        match self {
            Via::Pipe { read, .. } => Ok(splice(
                read.as_fd(),
                None,
                dst.as_fd(),
                None,
                len - at,
                SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK,
            )?),
            Via::Buffer(buf) => dst.try_write(&buf[at..len]),
        }
    }
}

/// Whether a splice failed because these descriptors cannot splice at all.
fn unsupported(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error().map(Errno::from_raw),
        Some(Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP)
    )
}

/// One direction: `src` to `dst` until `src` ends (then `dst`'s write side is shut) or either
/// fails.
async fn pump(src: &TcpStream, dst: &TcpStream) -> io::Result<()> {
    // No pipe before the first byte: an idle tunnel holds no more descriptors than its two.
    src.readable().await?;
    let mut via = Via::new();
    let mut any = false;
    loop {
        let len = match src.async_io(Interest::READABLE, || via.fill(src)).await {
            Ok(len) => len,
            Err(error) if !any && unsupported(&error) && matches!(via, Via::Pipe { .. }) => {
                via = Via::buffer();
                continue;
            }
            Err(error) => return Err(error),
        };
        if len == 0 {
            return shut_write(dst);
        }
        any = true;
        let mut at = 0;
        while at < len {
            match dst
                .async_io(Interest::WRITABLE, || via.drain(dst, at, len))
                .await?
            {
                0 => return Err(io::ErrorKind::WriteZero.into()),
                written => at += written,
            }
        }
    }
}

/// Shuts `stream`'s write side; one whose peer has gone already counts as shut.
fn shut_write(stream: &TcpStream) -> io::Result<()> {
    match nix::sys::socket::shutdown(stream.as_raw_fd(), nix::sys::socket::Shutdown::Write) {
        Ok(()) | Err(Errno::ENOTCONN) => Ok(()),
        Err(error) => Err(error.into()),
    }
}
