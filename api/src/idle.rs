//! Closes HTTP connections on which nothing moved for a while.
//!
//! `axum::serve` gives hyper no timer, so hyper's header read timeout never runs: a client
//! that sent half a request line, a body shorter than its `Content-Length`, or nothing at
//! all kept its connection, its task and its file descriptor for as long as it liked. An
//! [`IdleListener`] wraps each accepted connection in an [`IdleIo`], which fails a read
//! once nothing was read or written for its limit ([`HTTP_IDLE_TIMEOUT`] for the node's
//! HTTP listener): hyper then closes the connection (a request whose body stalled gets its
//! body error first). Idle keep-alive connections close after the same time, as nginx's
//! `keepalive_timeout` does.
//!
//! The clock is checked only when a read would wait: each read or write records when it
//! moved bytes (one `Instant::now()`), and the timer, armed once, re-arms itself from that
//! record when it fires early, so the hot path never touches the timer wheel.
//!
//! A request whose handler runs longer than the limit without any bytes moving could be
//! cut short if hyper reads meanwhile; the node's handlers end well within it (forwarded
//! requests time out at 30 s, Raft operations at 10 s).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::Context;
use std::task::Poll;
use std::task::ready;
use std::time::Duration;

use tokio::io::AsyncRead;
use tokio::io::AsyncWrite;
use tokio::io::ReadBuf;
use tokio::time::Instant;
use tokio::time::Sleep;

/// How long the node's HTTP connections may stay without reading or writing a byte.
pub const HTTP_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// A listener whose connections close after `limit` without traffic.
pub struct IdleListener<L> {
    inner: L,
    limit: Duration,
}

impl<L> IdleListener<L> {
    pub fn new(inner: L, limit: Duration) -> IdleListener<L> {
        IdleListener { inner, limit }
    }
}

impl<L> axum::serve::Listener for IdleListener<L>
where
    L: axum::serve::Listener,
    L::Io: Unpin,
{
    type Io = IdleIo<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, addr) = self.inner.accept().await;
        (IdleIo::new(io, self.limit), addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection whose reads fail with `TimedOut` once it moved no byte for its limit.
pub struct IdleIo<T> {
    io: T,
    limit: Duration,
    /// When a read or write last moved bytes.
    last: Instant,
    /// Fires at `last + limit` or earlier; re-armed from `last` when early.
    timer: Pin<Box<Sleep>>,
}

impl<T> IdleIo<T> {
    pub fn new(io: T, limit: Duration) -> IdleIo<T> {
        let last = Instant::now();
        IdleIo { io, limit, last, timer: Box::pin(tokio::time::sleep_until(last + limit)) }
    }

    /// Ready once `limit` passed since the last byte moved.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            ready!(self.timer.as_mut().poll(cx));
            let due = self.last + self.limit;
            if due <= Instant::now() {
                return Poll::Ready(());
            }
            self.timer.as_mut().reset(due);
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleIo<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(result) => {
                if buf.filled().len() > before {
                    this.last = Instant::now();
                }
                Poll::Ready(result)
            }
            Poll::Pending => match this.poll_idle(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no traffic on the connection for {:?}", this.limit),
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for IdleIo<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let written = ready!(Pin::new(&mut this.io).poll_write(cx, buf));
        if matches!(written, Ok(n) if n > 0) {
            this.last = Instant::now();
        }
        Poll::Ready(written)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let written = ready!(Pin::new(&mut this.io).poll_write_vectored(cx, bufs));
        if matches!(written, Ok(n) if n > 0) {
            this.last = Instant::now();
        }
        Poll::Ready(written)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;
    use tokio::io::AsyncWriteExt;

    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    const LIMIT: Duration = Duration::from_millis(300);
    /// Bound on every wait of these tests.
    const BOUNDED: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn a_read_fails_once_nothing_moved_for_the_limit() -> TestResult {
        let (_client, server) = tokio::io::duplex(64);
        let since = Instant::now();
        let mut io = IdleIo::new(server, LIMIT);
        times_out_a_limit_after(&mut io, since).await
    }

    /// The next read of `io` fails with `TimedOut`, and not before `LIMIT` passed since `since`.
    async fn times_out_a_limit_after(io: &mut IdleIo<tokio::io::DuplexStream>, since: Instant) -> TestResult {
        let mut buf = [0u8; 8];
        let read = tokio::time::timeout(BOUNDED, io.read(&mut buf)).await?;
        let err = read.err().ok_or("a silent peer's read succeeded")?;
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(since.elapsed() >= LIMIT, "failed {:?} after the last traffic, before the limit", since.elapsed());
        Ok(())
    }

    #[tokio::test]
    async fn traffic_either_way_restarts_the_limit() -> TestResult {
        for reading in [true, false] {
            let (mut client, server) = tokio::io::duplex(64);
            let mut io = IdleIo::new(server, LIMIT);
            let mut buf = [0u8; 8];
            tokio::time::sleep(LIMIT * 2 / 3).await;
            // Before the traffic, so the traffic's own record is not earlier than it.
            let since = Instant::now();
            if reading {
                client.write_all(b"ab").await?;
                assert_eq!(io.read(&mut buf).await?, 2);
            } else {
                io.write_all(b"answer").await?;
            }
            // Timed from the traffic, not from the start (which would fail a third of it later).
            times_out_a_limit_after(&mut io, since).await?;
        }
        Ok(())
    }

    /// An HTTP server behind the listener: a complete request is answered, a connection that
    /// sent half a request line is closed at the limit, and so is one idle after its answer.
    #[tokio::test]
    async fn the_http_server_closes_a_connection_that_stalls_mid_request() -> TestResult {
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = tcp.local_addr()?;
        let app = axum::Router::new().route("/x", axum::routing::get(|| async { "ok" }));
        let server = tokio::spawn(async move { axum::serve(IdleListener::new(tcp, LIMIT), app).await });

        let mut stalled = tokio::net::TcpStream::connect(addr).await?;
        stalled.write_all(b"GET /x HTTP/1.1\r\nHost: a\r\n").await?;
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(BOUNDED, stalled.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "a stalled request still held its connection after {BOUNDED:?}");

        let mut served = tokio::net::TcpStream::connect(addr).await?;
        served.write_all(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n").await?;
        let mut answer = Vec::new();
        let closed = tokio::time::timeout(BOUNDED, served.read_to_end(&mut answer)).await;
        assert!(closed.is_ok(), "an idle keep-alive connection was still open after {BOUNDED:?}");
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200 OK") && answer.ends_with("ok"), "{answer}");
        server.abort();
        Ok(())
    }
}
