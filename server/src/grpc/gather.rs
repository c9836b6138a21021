//! The request body of a call that tonic's generated service answers (a compressed
//! `ModelInfer`, `ModelStreamInfer`, every other RPC), handed over whole message
//! by whole message.
//!
//! tonic's decoder reserves a message's declared length as soon as its 5-byte
//! prefix arrives. [`Gathered`] holds a message back until all of it has arrived,
//! in a buffer that grows with the bytes that arrive and is charged to the
//! server-wide [`MessageBudget`], so tonic only ever reserves what is already here. A
//! frame that holds whole messages only (the usual small message) goes through
//! as it is: no copy.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::{Body, Frame};
use hyper::body::Incoming;
use tonic::Status;

use super::message_budget::{Charge, MessageBudget};

/// The length prefix of a gRPC message.
const PREFIX: usize = 5;

/// A call's body, released to tonic in whole messages (see the module docs).
pub(super) struct Gathered {
    inner: Incoming,
    held: Held,
    /// Trailers that came while a message was unfinished.
    trailers: Option<Frame<Bytes>>,
}

impl Gathered {
    pub(super) fn new(inner: Incoming, limit: usize, budget: &Arc<MessageBudget>) -> Gathered {
        Gathered {
            inner,
            held: Held::new(limit, budget),
            trailers: None,
        }
    }
}

/// The start of an unfinished message, and what it holds of the budget.
struct Held {
    partial: BytesMut,
    charge: Charge,
    limit: usize,
}

impl Held {
    fn new(limit: usize, budget: &Arc<MessageBudget>) -> Held {
        Held {
            partial: BytesMut::new(),
            charge: budget.charge(),
            limit,
        }
    }

    fn is_empty(&self) -> bool {
        self.partial.is_empty()
    }

    /// What is held (a message cut short), given back.
    fn take(&mut self) -> Bytes {
        self.charge.shrink_to(0);
        std::mem::take(&mut self.partial).freeze()
    }

    /// Adds `data` to what is held; returns the whole messages now held, if any.
    /// An error when the budget has no room for it.
    fn push(&mut self, data: Bytes) -> Result<Option<Bytes>, Status> {
        if self.partial.is_empty() && ready(&data, self.limit) == data.len() {
            return Ok(Some(data));
        }
        self.charge.grow_to(self.partial.len() + data.len())?;
        self.partial.put(data);
        let ready = ready(&self.partial, self.limit);
        let messages = self.partial.split_to(ready).freeze();
        if self.partial.is_empty() {
            // Give the buffer back with the charge: nothing is unfinished.
            self.partial = BytesMut::new();
        }
        self.charge.shrink_to(self.partial.len());
        Ok((!messages.is_empty()).then_some(messages))
    }
}

/// How much of `buf` tonic may have now: the whole messages it starts with, or
/// all of it once a prefix declares more than `limit` (tonic refuses that message
/// at its prefix, reserving nothing, after decoding the ones before it).
fn ready(buf: &[u8], limit: usize) -> usize {
    let mut at = 0;
    while let Some(prefix) = buf.get(at..at + PREFIX) {
        let length = (&prefix[1..]).get_u32() as usize;
        if length > limit {
            return buf.len();
        }
        if buf.len() - at - PREFIX < length {
            break;
        }
        at += PREFIX + length;
    }
    at
}

impl Body for Gathered {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        loop {
            if let Some(trailers) = this.trailers.take() {
                return Poll::Ready(Some(Ok(trailers)));
            }
            let Some(frame) = ready!(Pin::new(&mut this.inner).poll_frame(cx)) else {
                // What is left is cut short: tonic reports it as such.
                if this.held.is_empty() {
                    return Poll::Ready(None);
                }
                return Poll::Ready(Some(Ok(Frame::data(this.held.take()))));
            };
            let frame = frame.map_err(|e| Status::from_error(e.into()))?;
            match frame.into_data() {
                Ok(data) => {
                    if let Some(messages) = this.held.push(data)? {
                        return Poll::Ready(Some(Ok(Frame::data(messages))));
                    }
                }
                Err(trailers) if this.held.is_empty() => {
                    return Poll::Ready(Some(Ok(trailers)));
                }
                Err(trailers) => {
                    this.trailers = Some(trailers);
                    return Poll::Ready(Some(Ok(Frame::data(this.held.take()))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_empty() && self.trailers.is_none() && self.inner.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(length: usize) -> Vec<u8> {
        let mut m = vec![0u8];
        m.extend_from_slice(&(length as u32).to_be_bytes());
        m.resize(PREFIX + length, 7);
        m
    }

    #[test]
    fn messages_are_held_until_whole_and_charged_meanwhile() {
        let budget = MessageBudget::new(100);
        let mut held = Held::new(50, &budget);
        // Whole messages in one frame go through as they are.
        let one = Bytes::from(message(3));
        let through = held.push(one.clone()).unwrap().unwrap();
        assert_eq!(through.as_ptr(), one.as_ptr());
        // A message in pieces is held, and charged, until it is whole.
        let (a, b) = (message(30), message(4));
        assert!(held
            .push(Bytes::copy_from_slice(&a[..15]))
            .unwrap()
            .is_none());
        assert_eq!(budget.held(), 15);
        let mut rest = a[15..].to_vec();
        rest.extend_from_slice(&b[..3]);
        assert_eq!(&held.push(Bytes::from(rest)).unwrap().unwrap()[..], &a[..]);
        assert_eq!(budget.held(), 3);
        assert_eq!(held.take().len(), 3);
        assert_eq!(budget.held(), 0);
        // A message over the limit goes to tonic, which refuses it at its prefix.
        let too_long = Bytes::copy_from_slice(&message(51)[..20]);
        assert_eq!(held.push(too_long).unwrap().unwrap().len(), 20);
        assert_eq!(budget.held(), 0);
        // Over the budget: refused.
        let mut other = Held::new(1000, &budget);
        let big = message(200);
        let over = other.push(Bytes::copy_from_slice(&big[..150])).unwrap_err();
        assert_eq!(over.code(), tonic::Code::ResourceExhausted);
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn whole_messages_are_ready_and_an_oversized_one_at_once() {
        let mut two = message(3);
        two.extend(message(0));
        assert_eq!(ready(&two, 10), 8 + 5);
        assert_eq!(ready(&two[..7], 10), 0);
        assert_eq!(ready(&message(4)[..4], 10), 0);
        let mut then_oversized = message(3);
        then_oversized.extend_from_slice(&message(11)[..7]);
        assert_eq!(ready(&then_oversized, 10), 8 + 7);
    }
}
