//! Plain TCP tunnels on Linux: bytes move from socket to socket through a pipe per direction
//! with splice(2), never through user space.
//!
//! Invariant: a direction's pipe is filled only when empty and drained whole before the next
//! fill, so a would-block always names the socket waited on, never the pipe; every byte taken
//! from a source is counted once and written to the other socket in order; a source's end of
//! stream shuts the other socket's write side (half-close) once everything before it is
//! written. A direction that cannot splice (no pipe to be had, or a socket that refuses
//! splice before its first byte) copies through a buffer instead.

use super::body::{RelayEnd, Watch, RELAY_BUFFER};
use super::exchange::Counter;
use nix::errno::Errno;
use nix::fcntl::{splice, FcntlArg, OFlag, SpliceFFlags};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Copies bytes both ways between two TCP sockets, counted, until both sides have ended,
/// either fails, or `watch` ends it — [`super::body::relay`]'s contract, without the copies.
pub async fn relay(client: TcpStream, upstream: TcpStream, watch: Watch<'_>) -> RelayEnd {
    let both = async {
        tokio::try_join!(
            pump(&client, &upstream, &watch.up),
            pump(&upstream, &client, &watch.down)
        )
        .map(|_| ())
    };
    let end = watch.run(both).await;
    // The client hears the end at once (a plain socket's shutdown never waits).
    let _ = shut_write(&client);
    end
}

/// Bytes per pipe: the kernel's default pipe (64 KiB) made a bulk tunnel take a splice pair
/// per 64 KiB; larger pipes count against the user's pipe pages (`fs.pipe-user-pages-soft`),
/// so a refusal keeps the default.
const PIPE_BYTES: usize = 256 * 1024;

/// What a direction moves its bytes through.
enum Via {
    Pipe { read: OwnedFd, write: OwnedFd },
    Buffer(Box<[u8]>),
}

impl Via {
    /// A pipe, or a buffer where no pipe can be had (out of descriptors, say).
    fn new() -> Via {
        match nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC) {
            Ok((read, write)) => {
                let _ = nix::fcntl::fcntl(&write, FcntlArg::F_SETPIPE_SZ(PIPE_BYTES as i32));
                Via::Pipe { read, write }
            }
            Err(error) => {
                tracing::debug!(%error, "no pipe for a tunnel: copying through a buffer");
                Via::buffer()
            }
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

/// One direction: `src` to `dst`, counted into `moved`, until `src` ends (then `dst`'s
/// write side is shut) or either fails.
async fn pump(src: &TcpStream, dst: &TcpStream, moved: &Counter) -> io::Result<()> {
    // No pipe before the first byte: an idle tunnel holds no more descriptors than its two.
    src.readable().await?;
    let mut via = Via::new();
    let mut any = false;
    loop {
        let len = match src.async_io(Interest::READABLE, || via.fill(src)).await {
            Ok(len) => len,
            Err(error) if !any && unsupported(&error) && matches!(via, Via::Pipe { .. }) => {
                tracing::debug!(%error, "splice refused: copying through a buffer");
                via = Via::buffer();
                continue;
            }
            Err(error) => return Err(error),
        };
        if len == 0 {
            return shut_write(dst);
        }
        any = true;
        moved.fetch_add(len as u64, Ordering::Relaxed);
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
