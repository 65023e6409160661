//! A response body with the vault's secrets redacted as it streams.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use fastbox_vault::redact::Redactor;
use hyper::body::{Body, Frame};

pub(crate) struct Redacted<B> {
    inner: B,
    redactor: Option<Redactor>,
}

impl<B> Redacted<B> {
    pub fn new(inner: B, redactor: Redactor) -> Self {
        Self {
            inner,
            redactor: Some(redactor),
        }
    }
}

impl<B> Body for Redacted<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        loop {
            if self.redactor.is_none() {
                return Poll::Ready(None);
            }
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        let out = self.redactor.as_mut().expect("present").push(&data);
                        if out.is_empty() {
                            continue;
                        }
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                    }
                    // Trailers are dropped: they could carry what the body must not.
                    Err(_) => continue,
                },
                Poll::Ready(None) => {
                    let rest = self.redactor.take().expect("present").finish();
                    if rest.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(rest)))));
                }
            }
        }
    }
}
