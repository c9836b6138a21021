//! The control messages between the server and a worker host: small binary
//! frames over a Unix socket, each a 4-byte little-endian length then the body
//! (a tag byte, then fields). Tensor data never travels here: it is in the
//! arena, and messages carry only offsets, lengths, shapes and parameters.

use std::io::{self, Read, Write};

use kiln_worker_sdk::{
    BatcherKind, DataType, Param, ParamValue, RequestError, RequestErrorKind, Shape, TensorSpec,
    WorkerInfo, MAX_RANK,
};

/// The largest frame either side accepts (parameters and shapes only).
pub const MAX_FRAME: usize = 64 << 20;

/// A call from the server to the host (the first byte of its frame).
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Init = 1,
    Allocate = 2,
    Acquire = 3,
    Run = 4,
    Release = 5,
    Deallocate = 6,
    Destroy = 7,
}

impl Call {
    fn from_u8(tag: u8) -> Option<Call> {
        [
            Call::Init,
            Call::Allocate,
            Call::Acquire,
            Call::Run,
            Call::Release,
            Call::Deallocate,
            Call::Destroy,
        ]
        .into_iter()
        .find(|c| *c as u8 == tag)
    }
}

/// A reply's first byte: the call succeeded (its results follow) or failed (a
/// message follows).
pub const REPLY_OK: u8 = 0;
pub const REPLY_ERR: u8 = 1;

/// Why a frame could not be read or decoded.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The other side closed the socket (it exited, or died).
    #[error("the connection closed")]
    Closed,
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("frame of {0} bytes is larger than {MAX_FRAME}")]
    TooLarge(usize),
    #[error("malformed message: {0}")]
    Malformed(&'static str),
}

/// Writes one frame: `body` with its length before it.
pub fn write_frame(out: &mut impl Write, body: &[u8]) -> Result<(), WireError> {
    if body.len() > MAX_FRAME {
        return Err(WireError::TooLarge(body.len()));
    }
    let mut head = [0u8; 4];
    head.copy_from_slice(&(body.len() as u32).to_le_bytes());
    out.write_all(&head)?;
    out.write_all(body)?;
    Ok(())
}

/// Reads one frame into `body` (reused, so a steady load allocates nothing).
pub fn read_frame(input: &mut impl Read, body: &mut Vec<u8>) -> Result<(), WireError> {
    let mut head = [0u8; 4];
    match input.read_exact(&mut head) {
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(WireError::Closed),
        other => other?,
    }
    let len = u32::from_le_bytes(head) as usize;
    if len > MAX_FRAME {
        return Err(WireError::TooLarge(len));
    }
    body.clear();
    body.resize(len, 0);
    match input.read_exact(body) {
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(WireError::Closed),
        other => Ok(other?),
    }
}

/// Appends fields to a message body.
pub struct Writer<'a>(pub &'a mut Vec<u8>);

impl Writer<'_> {
    /// Starts a message with `tag` in the (cleared) buffer.
    pub fn start(buf: &mut Vec<u8>, tag: u8) -> Writer<'_> {
        buf.clear();
        buf.push(tag);
        Writer(buf)
    }

    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }

    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    pub fn usize(&mut self, v: usize) {
        self.u64(v as u64);
    }

    pub fn count(&mut self, n: usize) {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }

    pub fn str(&mut self, s: &str) {
        self.count(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }

    pub fn shape(&mut self, shape: &Shape) {
        let dims = shape.dims();
        self.u8(dims.len() as u8);
        for &d in dims {
            self.u64(d as u64);
        }
    }

    /// Dimensions of any rank (a model call's shapes, which the server checks).
    pub fn dims(&mut self, dims: &[i64]) {
        self.count(dims.len());
        dims.iter().for_each(|&d| self.u64(d as u64));
    }

    pub fn shapes(&mut self, shapes: &[Shape]) {
        self.count(shapes.len());
        shapes.iter().for_each(|s| self.shape(s));
    }

    pub fn params(&mut self, params: &[Param]) {
        self.count(params.len());
        for p in params {
            self.str(&p.key);
            match &p.value {
                ParamValue::Bool(v) => {
                    self.u8(0);
                    self.u8(u8::from(*v));
                }
                ParamValue::Int(v) => {
                    self.u8(1);
                    self.u64(*v as u64);
                }
                ParamValue::Float(v) => {
                    self.u8(2);
                    self.u64(v.to_bits());
                }
                ParamValue::Str(v) => {
                    self.u8(3);
                    self.str(v);
                }
                ParamValue::Uint(v) => {
                    self.u8(4);
                    self.u64(*v);
                }
            }
        }
    }

    pub fn tensor_specs(&mut self, specs: &[TensorSpec]) {
        self.count(specs.len());
        for spec in specs {
            self.str(&spec.name);
            self.u8(spec.dtype as u8);
            self.count(spec.dims.len());
            spec.dims.iter().for_each(|&d| self.u64(d as u64));
        }
    }

    pub fn info(&mut self, info: &WorkerInfo) {
        self.tensor_specs(&info.inputs);
        self.tensor_specs(&info.outputs);
        self.u32(info.max_batch_size);
        self.u8(info.batcher as u8);
        self.u8(u8::from(info.allow_ragged_batch));
    }

    pub fn request_error(&mut self, error: &RequestError) {
        self.u8(match error.kind {
            RequestErrorKind::Invalid => 0,
            RequestErrorKind::Internal => 1,
        });
        self.str(&error.message);
    }
}

/// Reads fields of a message body, checking every length.
pub struct Reader<'a> {
    rest: &'a [u8],
}

type Read_<T> = Result<T, WireError>;

impl<'a> Reader<'a> {
    pub fn new(body: &'a [u8]) -> Reader<'a> {
        Reader { rest: body }
    }

    fn take(&mut self, n: usize) -> Read_<&'a [u8]> {
        if self.rest.len() < n {
            return Err(WireError::Malformed("message cut short"));
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    pub fn u8(&mut self) -> Read_<u8> {
        Ok(self.take(1)?[0])
    }

    pub fn u32(&mut self) -> Read_<u32> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }

    pub fn u64(&mut self) -> Read_<u64> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }

    pub fn usize(&mut self) -> Read_<usize> {
        usize::try_from(self.u64()?).map_err(|_| WireError::Malformed("size too large"))
    }

    /// A count of items of at least `min_size` bytes each, checked against what
    /// is left (so a forged count cannot make the reader allocate).
    pub fn count(&mut self, min_size: usize) -> Read_<usize> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_size.max(1)) > self.rest.len() && n > 0 {
            return Err(WireError::Malformed("count larger than the message"));
        }
        Ok(n)
    }

    pub fn str(&mut self) -> Read_<&'a str> {
        let n = self.u32()? as usize;
        std::str::from_utf8(self.take(n)?).map_err(|_| WireError::Malformed("text is not UTF-8"))
    }

    pub fn call(&mut self) -> Read_<Call> {
        Call::from_u8(self.u8()?).ok_or(WireError::Malformed("unknown call"))
    }

    pub fn shape(&mut self) -> Read_<Shape> {
        let rank = self.u8()? as usize;
        if rank > MAX_RANK {
            return Err(WireError::Malformed("shape of too many dimensions"));
        }
        let mut dims = [0i64; MAX_RANK];
        for d in &mut dims[..rank] {
            *d = self.u64()? as i64;
        }
        Shape::new(&dims[..rank]).ok_or(WireError::Malformed("shape"))
    }

    pub fn dims(&mut self) -> Read_<Vec<i64>> {
        let n = self.count(8)?;
        (0..n).map(|_| self.u64().map(|d| d as i64)).collect()
    }

    /// Shapes appended to `out` (reused).
    pub fn shapes_into(&mut self, out: &mut Vec<Shape>) -> Read_<()> {
        let n = self.count(1)?;
        out.clear();
        for _ in 0..n {
            out.push(self.shape()?);
        }
        Ok(())
    }

    pub fn params_into(&mut self, out: &mut Vec<Param>) -> Read_<()> {
        let n = self.count(6)?;
        out.clear();
        for _ in 0..n {
            let key = self.str()?.into();
            let value = match self.u8()? {
                0 => ParamValue::Bool(self.u8()? != 0),
                1 => ParamValue::Int(self.u64()? as i64),
                2 => ParamValue::Float(f64::from_bits(self.u64()?)),
                3 => ParamValue::Str(self.str()?.into()),
                4 => ParamValue::Uint(self.u64()?),
                _ => return Err(WireError::Malformed("parameter value")),
            };
            out.push(Param { key, value });
        }
        Ok(())
    }

    fn tensor_specs(&mut self) -> Read_<Vec<TensorSpec>> {
        let n = self.count(9)?;
        let mut specs = Vec::with_capacity(n);
        for _ in 0..n {
            let name = self.str()?;
            let dtype = DataType::ALL
                .get(self.u8()? as usize)
                .copied()
                .ok_or(WireError::Malformed("datatype"))?;
            let rank = self.count(8)?;
            let dims: Vec<i64> = (0..rank)
                .map(|_| self.u64().map(|d| d as i64))
                .collect::<Read_<_>>()?;
            specs.push(TensorSpec::new(name, dtype, &dims));
        }
        Ok(specs)
    }

    pub fn info(&mut self) -> Read_<WorkerInfo> {
        let inputs = self.tensor_specs()?.into();
        let outputs = self.tensor_specs()?.into();
        let max_batch_size = self.u32()?;
        let batcher = match self.u8()? {
            0 => BatcherKind::Hard,
            1 => BatcherKind::Soft,
            2 => BatcherKind::Dynamic,
            3 => BatcherKind::Sequence,
            _ => return Err(WireError::Malformed("batcher")),
        };
        Ok(WorkerInfo {
            inputs,
            outputs,
            max_batch_size,
            batcher,
            allow_ragged_batch: self.u8()? != 0,
        })
    }

    pub fn request_error(&mut self) -> Read_<RequestError> {
        let kind = self.u8()?;
        let message = self.str()?;
        Ok(match kind {
            0 => RequestError::invalid(message),
            _ => RequestError::internal(message),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip() {
        let info = WorkerInfo {
            inputs: vec![TensorSpec::new("IN", DataType::Fp16, &[-1, 3])].into(),
            outputs: vec![TensorSpec::new("OUT", DataType::Bytes, &[1])].into(),
            max_batch_size: 8,
            batcher: BatcherKind::Dynamic,
            allow_ragged_batch: true,
        };
        let params = vec![
            Param {
                key: "a".into(),
                value: ParamValue::Float(1.5),
            },
            Param {
                key: "b".into(),
                value: ParamValue::Uint(u64::MAX),
            },
            Param {
                key: "c".into(),
                value: ParamValue::Str("x".into()),
            },
        ];
        let shapes = [Shape::new(&[2, -1, 7]).unwrap(), Shape::scalar()];
        let mut buf = Vec::new();
        let mut w = Writer::start(&mut buf, Call::Run as u8);
        w.info(&info);
        w.params(&params);
        w.shapes(&shapes);
        w.request_error(&RequestError::invalid("no"));
        let mut framed = Vec::new();
        write_frame(&mut framed, &buf).unwrap();
        let mut body = Vec::new();
        read_frame(&mut framed.as_slice(), &mut body).unwrap();
        let mut r = Reader::new(&body);
        assert_eq!(r.call().unwrap(), Call::Run);
        assert_eq!(r.info().unwrap(), info);
        let mut got = Vec::new();
        r.params_into(&mut got).unwrap();
        assert_eq!(got, params);
        let mut got_shapes = Vec::new();
        r.shapes_into(&mut got_shapes).unwrap();
        assert_eq!(got_shapes, shapes);
        assert_eq!(r.request_error().unwrap(), RequestError::invalid("no"));
        assert!(r.u8().is_err());
    }

    #[test]
    fn forged_and_cut_messages_are_errors() {
        // A count of 4 billion items in a 5-byte message.
        let mut r = Reader::new(&[0xff, 0xff, 0xff, 0xff, 0]);
        assert!(r.count(1).is_err());
        let mut body = Vec::new();
        let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
        assert!(matches!(
            read_frame(&mut &huge[..], &mut body),
            Err(WireError::TooLarge(_))
        ));
        assert!(matches!(
            read_frame(&mut &[5, 0, 0, 0, 1][..], &mut body),
            Err(WireError::Closed)
        ));
        assert!(Reader::new(&[9]).call().is_err());
    }
}
