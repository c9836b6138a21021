//! HPACK (RFC 7541) for the load generator's HTTP/2 client: decoding (integers,
//! strings raw or Huffman-coded, the static table and the dynamic table), and the
//! integer encoding the client's own header blocks, written by hand in `grpc.rs`,
//! use.

use std::collections::VecDeque;
use std::sync::OnceLock;

/// A header block the decoder cannot read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HpackError(pub &'static str);

impl std::fmt::Display for HpackError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HPACK: {}", self.0)
    }
}

/// RFC 7541 appendix A.
const STATIC_TABLE: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// The dynamic table size the client announces (the protocol's default).
pub const TABLE_SIZE: usize = 4096;

/// An HPACK decoder: one per connection, fed every header block in order.
pub struct Decoder {
    /// Newest entry first.
    table: VecDeque<(Vec<u8>, Vec<u8>)>,
    size: usize,
    max_size: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder {
            table: VecDeque::new(),
            size: 0,
            max_size: TABLE_SIZE,
        }
    }
}

/// A string of a header block: borrowed when raw, decoded when Huffman-coded.
enum Text<'a> {
    Raw(&'a [u8]),
    Owned(Vec<u8>),
}

impl Text<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Text::Raw(b) => b,
            Text::Owned(b) => b,
        }
    }
}

impl Decoder {
    /// Decodes one complete header block, calling `field(name, value)` for each
    /// header in order.
    pub fn decode(
        &mut self,
        mut block: &[u8],
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), HpackError> {
        while let Some(&first) = block.first() {
            if first & 0x80 != 0 {
                // Indexed header field.
                let index = integer(&mut block, 7)?;
                let (name, value) = self.entry(index)?;
                field(name, value);
            } else if first & 0x40 != 0 {
                // Literal with incremental indexing.
                let (name, value) = self.literal(&mut block, 6)?;
                field(name.bytes(), value.bytes());
                let (name, value) = (name.bytes().to_vec(), value.bytes().to_vec());
                self.insert(name, value);
            } else if first & 0x20 != 0 {
                // Dynamic table size update.
                let size = integer(&mut block, 5)?;
                if size > TABLE_SIZE {
                    return Err(HpackError("table size update above the announced size"));
                }
                self.max_size = size;
                self.evict();
            } else {
                // Literal without indexing, or never indexed.
                let (name, value) = self.literal(&mut block, 4)?;
                field(name.bytes(), value.bytes());
            }
        }
        Ok(())
    }

    fn literal<'b>(
        &self,
        block: &mut &'b [u8],
        prefix: u8,
    ) -> Result<(Text<'b>, Text<'b>), HpackError> {
        let index = integer(block, prefix)?;
        let name = if index == 0 {
            string(block)?
        } else {
            Text::Owned(self.entry(index)?.0.to_vec())
        };
        Ok((name, string(block)?))
    }

    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        match index {
            0 => Err(HpackError("index 0")),
            1..=61 => {
                let (name, value) = STATIC_TABLE[index - 1];
                Ok((name.as_bytes(), value.as_bytes()))
            }
            _ => self
                .table
                .get(index - 62)
                .map(|(n, v)| (n.as_slice(), v.as_slice()))
                .ok_or(HpackError("index beyond the dynamic table")),
        }
    }

    fn insert(&mut self, name: Vec<u8>, value: Vec<u8>) {
        let size = name.len() + value.len() + 32;
        self.table.push_front((name, value));
        self.size += size;
        self.evict();
    }

    fn evict(&mut self) {
        while self.size > self.max_size {
            match self.table.pop_back() {
                Some((n, v)) => self.size -= n.len() + v.len() + 32,
                None => break,
            }
        }
    }
}

/// An integer with an `prefix`-bit prefix (RFC 7541 section 5.1).
fn integer(block: &mut &[u8], prefix: u8) -> Result<usize, HpackError> {
    let cut = HpackError("header block cut short");
    let (&first, rest) = block.split_first().ok_or(cut)?;
    *block = rest;
    let mask = (1u16 << prefix) as u8 - 1;
    let mut value = usize::from(first & mask);
    if value < usize::from(mask) {
        return Ok(value);
    }
    let mut shift = 0;
    loop {
        let (&b, rest) = block.split_first().ok_or(cut)?;
        *block = rest;
        if shift > 21 {
            return Err(HpackError("integer too large"));
        }
        value += usize::from(b & 0x7f) << shift;
        shift += 7;
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
}

/// Writes `value` as an integer with a `prefix`-bit prefix, `high` in the first
/// byte's other bits (RFC 7541 section 5.1).
pub fn write_integer(out: &mut Vec<u8>, mut value: usize, prefix: u8, high: u8) {
    let max = (1usize << prefix) - 1;
    if value < max {
        out.push(high | value as u8);
        return;
    }
    out.push(high | max as u8);
    value -= max;
    while value >= 0x80 {
        out.push((value & 0x7f) as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// A string literal (RFC 7541 section 5.2).
fn string<'b>(block: &mut &'b [u8]) -> Result<Text<'b>, HpackError> {
    let huffman = block.first().is_some_and(|b| b & 0x80 != 0);
    let len = integer(block, 7)?;
    if block.len() < len {
        return Err(HpackError("header block cut short"));
    }
    let (s, rest) = block.split_at(len);
    *block = rest;
    Ok(if huffman {
        Text::Owned(huffman_decode(s)?)
    } else {
        Text::Raw(s)
    })
}

/// Code lengths of the HPACK Huffman code (RFC 7541 appendix B), symbols 0 to 256
/// (256 is EOS). The code is canonical: codes of one length are consecutive in
/// symbol order, and each length continues where the shorter ones ended.
const CODE_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, //
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28, //
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, //
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, //
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, //
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, //
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, //
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, //
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, //
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, //
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, //
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23, //
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, //
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, //
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, //
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, //
    30,
];

const EOS: u16 = 256;
const MAX_CODE_LENGTH: usize = 30;

/// The canonical code, by length: how many codes, the first code, and where its
/// symbols start in `symbols` (sorted by length, then symbol).
struct Canonical {
    count: [u32; MAX_CODE_LENGTH + 1],
    first: [u32; MAX_CODE_LENGTH + 1],
    start: [usize; MAX_CODE_LENGTH + 1],
    symbols: Vec<u16>,
}

fn canonical() -> &'static Canonical {
    static CODE: OnceLock<Canonical> = OnceLock::new();
    CODE.get_or_init(|| {
        let mut symbols: Vec<u16> = (0..=EOS).collect();
        symbols.sort_by_key(|&s| (CODE_LENGTHS[usize::from(s)], s));
        let mut c = Canonical {
            count: [0; MAX_CODE_LENGTH + 1],
            first: [0; MAX_CODE_LENGTH + 1],
            start: [0; MAX_CODE_LENGTH + 1],
            symbols,
        };
        for &len in &CODE_LENGTHS {
            c.count[usize::from(len)] += 1;
        }
        let (mut code, mut start) = (0u32, 0usize);
        for len in 1..=MAX_CODE_LENGTH {
            c.first[len] = code;
            c.start[len] = start;
            code = (code + c.count[len]) << 1;
            start += c.count[len] as usize;
        }
        c
    })
}

/// Decodes a Huffman-coded string; the padding must be the EOS code's leading ones.
pub fn huffman_decode(input: &[u8]) -> Result<Vec<u8>, HpackError> {
    let c = canonical();
    let mut out = Vec::with_capacity(input.len() * 8 / 5);
    let (mut code, mut len) = (0u32, 0usize);
    for &byte in input {
        for bit in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> bit) & 1);
            len += 1;
            let offset = code.wrapping_sub(c.first[len]);
            if offset < c.count[len] {
                let symbol = c.symbols[c.start[len] + offset as usize];
                let symbol = u8::try_from(symbol)
                    .map_err(|_| HpackError("EOS inside a Huffman-coded string"))?;
                out.push(symbol);
                (code, len) = (0, 0);
            } else if len == MAX_CODE_LENGTH {
                return Err(HpackError("invalid Huffman code"));
            }
        }
    }
    // At most 7 bits of padding, all ones.
    if len > 7 || code != (1 << len) - 1 {
        return Err(HpackError("invalid Huffman padding"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// Huffman-encodes with the same canonical code, for round trips.
    fn huffman_encode(s: &[u8]) -> Vec<u8> {
        let c = canonical();
        let code_of = |sym: u16| {
            let len = usize::from(CODE_LENGTHS[usize::from(sym)]);
            let rank = c.symbols[c.start[len]..]
                .iter()
                .position(|&x| x == sym)
                .unwrap();
            (c.first[len] + rank as u32, len)
        };
        let (mut out, mut acc, mut bits) = (Vec::new(), 0u64, 0usize);
        for &b in s {
            let (code, len) = code_of(u16::from(b));
            acc = (acc << len) | u64::from(code);
            bits += len;
            while bits >= 8 {
                out.push((acc >> (bits - 8)) as u8);
                bits -= 8;
            }
        }
        if bits > 0 {
            out.push(((acc << (8 - bits)) as u8) | ((1u8 << (8 - bits)) - 1));
        }
        out
    }

    #[test]
    fn integers_as_rfc_7541_writes_them() {
        let mut b = Vec::new();
        write_integer(&mut b, 10, 5, 0);
        write_integer(&mut b, 1337, 5, 0);
        write_integer(&mut b, 42, 8, 0);
        assert_eq!(b, [0x0a, 0x1f, 0x9a, 0x0a, 0x2a]);
    }

    #[test]
    fn huffman_examples_of_rfc_7541() {
        let cases = [
            ("f1e3 c2e5 f23a 6ba0 ab90 f4ff", "www.example.com"),
            ("a8eb 1064 9cbf", "no-cache"),
            ("25a8 49e9 5ba9 7d7f", "custom-key"),
            ("25a8 49e9 5bb8 e8b4 bf", "custom-value"),
        ];
        for (coded, text) in cases {
            assert_eq!(huffman_decode(&hex(coded)), Ok(text.as_bytes().to_vec()));
            assert_eq!(huffman_encode(text.as_bytes()), hex(coded), "{text}");
        }
    }

    #[test]
    fn huffman_round_trips_every_byte() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(huffman_decode(&huffman_encode(&all)), Ok(all));
        assert_eq!(
            huffman_decode(&huffman_encode(b"grpc-status")),
            Ok(b"grpc-status".to_vec())
        );
        // Padding longer than 7 bits, or not all ones, is refused.
        assert!(huffman_decode(&[0xff, 0xff]).is_err());
        assert!(huffman_decode(&[0x00]).is_err());
    }

    fn decode_all(d: &mut Decoder, block: &[u8]) -> Vec<(String, String)> {
        let mut fields = Vec::new();
        d.decode(block, |n, v| {
            fields.push((
                String::from_utf8_lossy(n).into_owned(),
                String::from_utf8_lossy(v).into_owned(),
            ))
        })
        .unwrap();
        fields
    }

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn request_examples_of_rfc_7541_with_the_dynamic_table() {
        // Appendix C.3 (raw strings), then C.4 (Huffman), each on its own decoder.
        let c3 = [
            "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
            "8286 84be 5808 6e6f 2d63 6163 6865",
            "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
        ];
        let c4 = [
            "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
            "8286 84be 5886 a8eb 1064 9cbf",
            "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
        ];
        let want = [
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
            ]),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache"),
            ]),
            pairs(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value"),
            ]),
        ];
        for blocks in [c3, c4] {
            let mut d = Decoder::default();
            for (block, want) in blocks.iter().zip(&want) {
                assert_eq!(&decode_all(&mut d, &hex(block)), want);
            }
            assert_eq!(d.size, 164);
            assert_eq!(d.table.len(), 3);
        }
    }

    #[test]
    fn size_updates_evict_and_bad_blocks_are_refused() {
        let mut d = Decoder::default();
        decode_all(&mut d, &hex("4004 6e61 6d65 0576 616c 7565")); // name: value, indexed
        assert_eq!(decode_all(&mut d, &hex("be")), pairs(&[("name", "value")]));
        decode_all(&mut d, &hex("20")); // size update to 0: the table empties
        assert!(d.decode(&hex("be"), |_, _| {}).is_err());
        assert!(d.decode(&hex("3fe1 1f"), |_, _| {}).is_ok(), "4096");
        assert!(d.decode(&hex("3fe2 1f"), |_, _| {}).is_err(), "above 4096");
        assert!(d.decode(&hex("80"), |_, _| {}).is_err(), "index 0");
        assert!(d.decode(&hex("0004 6e61"), |_, _| {}).is_err(), "cut short");
    }
}
