//! Bytes that keep what they hold of the server's client-bytes budget until the
//! last of them is dropped ([`Bytes::from_owner`], no copy): a decoded frame's
//! pixels inside the model's request, a result inside actix-ws' channel. A
//! [`Taken`] counter learns when actix-ws has taken a message out of its channel
//! (encoded it into the connection's write buffer): that is how the writer knows
//! whether the client reads (`session.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use kiln_core::memory::client_bytes::Reservation;
use tokio::sync::Notify;

/// Messages whose bytes were dropped, and a wake-up for each.
#[derive(Default)]
pub struct Taken {
    count: AtomicU64,
    notify: Notify,
}

impl Taken {
    /// Messages taken so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Acquire)
    }

    /// Completes at the next message taken (or at once for one taken since the
    /// last wait: `Notify` keeps one permit).
    pub async fn next(&self) {
        self.notify.notified().await;
    }
}

struct Owner {
    bytes: Bytes,
    _held: Option<Reservation>,
    taken: Option<Arc<Taken>>,
}

impl AsRef<[u8]> for Owner {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        if let Some(taken) = &self.taken {
            taken.count.fetch_add(1, Ordering::AcqRel);
            taken.notify.notify_one();
        }
    }
}

/// `bytes`, holding `held` until they are dropped, and counted in `taken` then.
pub fn hold(bytes: Bytes, held: Option<Reservation>, taken: Option<Arc<Taken>>) -> Bytes {
    if held.is_none() && taken.is_none() {
        return bytes;
    }
    Bytes::from_owner(Owner {
        bytes,
        _held: held,
        taken,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::memory::client_bytes::{ClientBytes, Use};

    #[test]
    fn the_reservation_lives_as_long_as_the_bytes() {
        let budget = ClientBytes::new(100);
        let taken = Arc::new(Taken::default());
        let held = budget.reserve(Use::DecodedImage, 10).unwrap();
        let bytes = hold(
            Bytes::from(vec![7; 10]),
            Some(held),
            Some(Arc::clone(&taken)),
        );
        let slice = bytes.slice(2..4);
        drop(bytes);
        assert_eq!((budget.held(), taken.count()), (10, 0));
        assert_eq!(&slice[..], &[7, 7]);
        drop(slice);
        assert_eq!((budget.held(), taken.count()), (0, 1));
    }
}
