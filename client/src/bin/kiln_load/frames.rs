//! HTTP/2 frames as the load generator's gRPC client ([`super::grpc`]) writes and
//! reads them (types, flags, headers, payloads without padding), and the gRPC
//! messages of a stream's answers cut at their length prefixes ([`Answers`]).

pub(crate) const DATA: u8 = 0x0;
pub(crate) const HEADERS: u8 = 0x1;
pub(crate) const RST_STREAM: u8 = 0x3;
pub(crate) const SETTINGS: u8 = 0x4;
pub(crate) const PUSH_PROMISE: u8 = 0x5;
pub(crate) const PING: u8 = 0x6;
pub(crate) const GOAWAY: u8 = 0x7;
pub(crate) const WINDOW_UPDATE: u8 = 0x8;
pub(crate) const CONTINUATION: u8 = 0x9;

pub(crate) const END_STREAM: u8 = 0x1;
pub(crate) const ACK: u8 = 0x1;
pub(crate) const END_HEADERS: u8 = 0x4;
pub(crate) const PADDED: u8 = 0x8;
pub(crate) const PRIORITY: u8 = 0x20;

/// The largest frame the client accepts: the protocol's default, not raised.
pub(crate) const MAX_FRAME: usize = 16_384;
/// The data of a DATA frame, without padding.
pub(crate) fn data_payload(payload: &[u8], flags: u8) -> Result<&[u8], String> {
    if flags & PADDED == 0 {
        return Ok(payload);
    }
    let malformed = || "HTTP/2: malformed DATA".to_owned();
    let (&pad, rest) = payload.split_first().ok_or_else(malformed)?;
    rest.get(
        ..rest
            .len()
            .checked_sub(usize::from(pad))
            .ok_or_else(malformed)?,
    )
    .ok_or_else(malformed)
}

/// The header block fragment of a HEADERS frame, without padding and priority.
pub(crate) fn header_fragment(payload: &[u8], flags: u8) -> Result<&[u8], String> {
    let malformed = || "HTTP/2: malformed HEADERS".to_owned();
    let mut p = payload;
    let mut pad = 0;
    if flags & PADDED != 0 {
        let (&n, rest) = p.split_first().ok_or_else(malformed)?;
        pad = usize::from(n);
        p = rest;
    }
    if flags & PRIORITY != 0 {
        p = p.get(5..).ok_or_else(malformed)?;
    }
    p.get(..p.len().checked_sub(pad).ok_or_else(malformed)?)
        .ok_or_else(malformed)
}

/// A frame header: length, type, flags, stream id.
pub(crate) fn frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// The answer messages of a stream: their boundaries, and whether each carries an
/// `error_message`.
#[derive(Default)]
pub(crate) struct Answers {
    /// The current message's prefix and first bytes.
    pub(crate) head: Vec<u8>,
    /// Bytes of the current message still to come, once its prefix is read.
    pub(crate) left: Option<usize>,
    /// Complete messages: `Err` with its `error_message` when it has one.
    pub(crate) done: Vec<Result<(), String>>,
}

/// The first bytes of an answer kept to read its `error_message`.
pub(crate) const ANSWER_HEAD: usize = 5 + 256;

impl Answers {
    /// Takes the next DATA of the stream.
    pub(crate) fn take(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let Some(left) = self.left else {
                // The prefix: a compression flag, then the length.
                let n = (5 - self.head.len()).min(data.len());
                self.head.extend_from_slice(&data[..n]);
                data = &data[n..];
                if self.head.len() == 5 {
                    let h = &self.head;
                    let len = u32::from_be_bytes([h[1], h[2], h[3], h[4]]) as usize;
                    self.left = Some(len);
                    if len == 0 {
                        self.complete();
                    }
                }
                continue;
            };
            let n = left.min(data.len());
            let keep = n.min(ANSWER_HEAD.saturating_sub(self.head.len()));
            self.head.extend_from_slice(&data[..keep]);
            data = &data[n..];
            self.left = Some(left - n);
            if left == n {
                self.complete();
            }
        }
    }

    /// A message is complete: an error when its first field, `error_message`
    /// (field 1, length-delimited: tag 0x0a), is not empty.
    fn complete(&mut self) {
        let body = self.head.get(5..).unwrap_or_default();
        let outcome = match body.split_first() {
            Some((0x0a, rest)) => {
                let mut rest = rest;
                let len = prost::encoding::decode_varint(&mut rest).unwrap_or(0) as usize;
                if len == 0 {
                    Ok(())
                } else {
                    let text = &rest[..len.min(rest.len())];
                    Err(format!("stream error: {}", String::from_utf8_lossy(text)))
                }
            }
            _ => Ok(()),
        };
        self.done.push(outcome);
        self.head.clear();
        self.left = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_answers_are_cut_at_their_prefixes() {
        let mut a = Answers::default();
        // An answer without error (field 2 only), then one with an error_message,
        // fed in pieces that cut across both.
        let ok = [0u8, 0, 0, 0, 3, 0x12, 0x01, 0x00];
        let err = [0u8, 0, 0, 0, 4, 0x0a, 0x02, b'n', b'o'];
        let mut all = ok.to_vec();
        all.extend_from_slice(&err);
        for piece in all.chunks(3) {
            a.take(piece);
        }
        assert_eq!(a.done, vec![Ok(()), Err("stream error: no".into())]);
        a.take(&[0, 0, 0, 0, 0]); // an empty message
        assert_eq!(a.done.len(), 3);
    }

    #[test]
    fn header_fragments_lose_padding_and_priority() {
        assert_eq!(header_fragment(&[0x88], 0), Ok(&[0x88][..]));
        assert_eq!(header_fragment(&[2, 0x88, 0, 0], PADDED), Ok(&[0x88][..]));
        assert_eq!(
            header_fragment(&[0, 0, 0, 1, 16, 0x88], PRIORITY),
            Ok(&[0x88][..])
        );
        assert!(header_fragment(&[5, 0x88], PADDED).is_err());
    }
}
