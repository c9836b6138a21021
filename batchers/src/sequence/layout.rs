//! Where each worker input of a sequence batch comes from: the client's request, a
//! control value the batcher fills in, or the sequence's state.

use bytes::Bytes;
use kiln_worker_sdk::{encode_bytes, DataType, Shape};

use super::SequenceId;
use crate::request::Tensor;

/// A control input's meaning (Triton's control kinds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// 1 on a sequence's first request, else 0.
    Start,
    /// 1 on a sequence's last request, else 0.
    End,
    /// 1 on every row that holds a request.
    Ready,
    /// The sequence's correlation id.
    CorrId,
}

impl Control {
    /// Triton's name of the kind.
    pub const fn triton_kind(self) -> &'static str {
        match self {
            Control::Start => "CONTROL_SEQUENCE_START",
            Control::End => "CONTROL_SEQUENCE_END",
            Control::Ready => "CONTROL_SEQUENCE_READY",
            Control::CorrId => "CONTROL_SEQUENCE_CORRID",
        }
    }
}

/// The source of one worker input.
#[derive(Debug, Clone, PartialEq)]
pub enum InputSource {
    /// The client's next input (the client's inputs keep the worker's order).
    Client,
    /// A control value in the input's datatype.
    Control {
        kind: Control,
        dtype: DataType,
        zero: Bytes,
        one: Bytes,
    },
    /// The sequence's state tensor of this index.
    State(usize),
}

/// A state tensor the server keeps per sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct StateSpec {
    pub dtype: DataType,
    /// The state's shape for one sequence, without the batch dimension.
    pub dims: Shape,
    /// The state at a sequence's start (zeros unless declared).
    pub initial: Bytes,
}

/// How a sequence request's worker inputs are assembled.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InputLayout {
    /// One source per worker input, in the worker's order.
    pub sources: Vec<InputSource>,
    pub states: Vec<StateSpec>,
    /// Whether the worker batches (tensors carry a batch dimension of 1).
    pub batched: bool,
}

/// `value` as one element of `dtype`, little-endian; `None` when it does not fit.
pub fn scalar_bytes(dtype: DataType, value: f64) -> Option<Bytes> {
    let fits = |lo: f64, hi: f64| value.fract() == 0.0 && value >= lo && value <= hi;
    let bytes: Vec<u8> = match dtype {
        DataType::Bool if value == 0.0 || value == 1.0 => vec![value as u8],
        DataType::Uint8 if fits(0.0, 255.0) => vec![value as u8],
        DataType::Int8 if fits(-128.0, 127.0) => (value as i8).to_le_bytes().to_vec(),
        DataType::Uint16 if fits(0.0, 65535.0) => (value as u16).to_le_bytes().to_vec(),
        DataType::Int16 if fits(-32768.0, 32767.0) => (value as i16).to_le_bytes().to_vec(),
        DataType::Uint32 if fits(0.0, u32::MAX as f64) => (value as u32).to_le_bytes().to_vec(),
        DataType::Int32 if fits(i32::MIN as f64, i32::MAX as f64) => {
            (value as i32).to_le_bytes().to_vec()
        }
        DataType::Uint64 if fits(0.0, 1.8e19) => (value as u64).to_le_bytes().to_vec(),
        DataType::Int64 if fits(-9.2e18, 9.2e18) => (value as i64).to_le_bytes().to_vec(),
        DataType::Fp32 => (value as f32).to_le_bytes().to_vec(),
        DataType::Fp64 => value.to_le_bytes().to_vec(),
        _ => return None,
    };
    Some(Bytes::from(bytes))
}

/// `count` copies of one element.
pub fn repeat(element: &[u8], count: usize) -> Bytes {
    Bytes::from(element.repeat(count))
}

impl InputLayout {
    /// A control source for an input of `dtype`; `None` when the datatype cannot hold
    /// 0 and 1 (or, for CORRID, an id).
    pub fn control(kind: Control, dtype: DataType) -> Option<InputSource> {
        let (zero, one) = match (kind, dtype) {
            (Control::CorrId, DataType::Bytes) => (Bytes::new(), Bytes::new()),
            (Control::CorrId, DataType::Uint64 | DataType::Int64)
            | (Control::CorrId, DataType::Uint32 | DataType::Int32) => {
                (scalar_bytes(dtype, 0.0)?, Bytes::new())
            }
            (Control::CorrId, _) | (_, DataType::Bytes) => return None,
            _ => (scalar_bytes(dtype, 0.0)?, scalar_bytes(dtype, 1.0)?),
        };
        Some(InputSource::Control {
            kind,
            dtype,
            zero,
            one,
        })
    }

    /// The shape of a one-row tensor whose per-row dims are `dims`.
    fn row_shape(&self, dims: &Shape) -> Shape {
        if self.batched {
            dims.with_batch(1).unwrap_or(*dims)
        } else {
            *dims
        }
    }

    /// The CORRID value of sequence `id` for a control input of `dtype`; `None` when
    /// the id does not fit the datatype.
    pub fn corrid(dtype: DataType, id: &SequenceId) -> Option<Bytes> {
        match (dtype, id) {
            (DataType::Bytes, SequenceId::Text(s)) => Some(Bytes::from(encode_bytes(&[s]))),
            (DataType::Bytes, SequenceId::Number(n)) => {
                Some(Bytes::from(encode_bytes(&[n.to_string()])))
            }
            (DataType::Uint64, SequenceId::Number(n)) => {
                Some(Bytes::copy_from_slice(&n.to_le_bytes()))
            }
            (DataType::Int64, SequenceId::Number(n)) => i64::try_from(*n)
                .ok()
                .map(|v| Bytes::copy_from_slice(&v.to_le_bytes())),
            (DataType::Uint32, SequenceId::Number(n)) => u32::try_from(*n)
                .ok()
                .map(|v| Bytes::copy_from_slice(&v.to_le_bytes())),
            (DataType::Int32, SequenceId::Number(n)) => i32::try_from(*n)
                .ok()
                .map(|v| Bytes::copy_from_slice(&v.to_le_bytes())),
            _ => None,
        }
    }

    /// The CORRID input's datatype, if the worker declares one.
    pub fn corrid_dtype(&self) -> Option<DataType> {
        self.sources.iter().find_map(|s| match s {
            InputSource::Control {
                kind: Control::CorrId,
                dtype,
                ..
            } => Some(*dtype),
            _ => None,
        })
    }

    /// The worker inputs of one request: its client tensors (in order) with the
    /// control values and the sequence's `state` (moved in) put in their places.
    pub fn assemble(
        &self,
        client: Vec<Tensor>,
        state: Vec<Bytes>,
        flags: (bool, bool),
        corrid: &Bytes,
    ) -> Vec<Tensor> {
        let (start, end) = flags;
        let mut client = client.into_iter();
        let mut state: Vec<Option<Bytes>> = state.into_iter().map(Some).collect();
        let one = Shape::new(&[1]).unwrap_or(Shape::scalar());
        self.sources
            .iter()
            .filter_map(|source| match source {
                InputSource::Client => client.next(),
                InputSource::Control {
                    kind,
                    dtype,
                    zero,
                    one: yes,
                } => {
                    let set = match kind {
                        Control::Start => start,
                        Control::End => end,
                        Control::Ready => true,
                        Control::CorrId => false,
                    };
                    let data = match kind {
                        Control::CorrId => corrid.clone(),
                        _ if set => yes.clone(),
                        _ => zero.clone(),
                    };
                    Some(Tensor {
                        dtype: *dtype,
                        shape: self.row_shape(&one),
                        data,
                    })
                }
                InputSource::State(k) => {
                    let spec = self.states.get(*k)?;
                    let data = state
                        .get_mut(*k)
                        .and_then(Option::take)
                        .unwrap_or_else(|| spec.initial.clone());
                    Some(Tensor {
                        dtype: spec.dtype,
                        shape: self.row_shape(&spec.dims),
                        data,
                    })
                }
            })
            .collect()
    }

    /// Every sequence's state at its start.
    pub fn initial_states(&self) -> Vec<Bytes> {
        self.states.iter().map(|s| s.initial.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_state_fill_their_places() {
        let dims = Shape::new(&[2]).unwrap();
        let layout = InputLayout {
            sources: vec![
                InputLayout::control(Control::Start, DataType::Int32).unwrap(),
                InputSource::Client,
                InputSource::State(0),
                InputLayout::control(Control::CorrId, DataType::Uint64).unwrap(),
                InputLayout::control(Control::Ready, DataType::Bool).unwrap(),
            ],
            states: vec![StateSpec {
                dtype: DataType::Fp32,
                dims,
                initial: repeat(&0f32.to_le_bytes(), 2),
            }],
            batched: true,
        };
        let client = Tensor {
            dtype: DataType::Uint8,
            shape: Shape::new(&[1, 3]).unwrap(),
            data: Bytes::from_static(&[1, 2, 3]),
        };
        let corrid = InputLayout::corrid(DataType::Uint64, &SequenceId::Number(42)).unwrap();
        let state = vec![repeat(&1.5f32.to_le_bytes(), 2)];
        let t = layout.assemble(vec![client], state, (true, false), &corrid);
        assert_eq!(t.len(), 5);
        assert_eq!(&t[0].data[..], &1i32.to_le_bytes());
        assert_eq!(t[0].shape.dims(), &[1, 1]);
        assert_eq!(&t[1].data[..], &[1, 2, 3]);
        assert_eq!(t[2].shape.dims(), &[1, 2]);
        assert_eq!(&t[2].data[..4], &1.5f32.to_le_bytes());
        assert_eq!(&t[3].data[..], &42u64.to_le_bytes());
        assert_eq!(&t[4].data[..], &[1]);
        // Not a start: START is 0; a missing state falls back to the initial one.
        let t = layout.assemble(Vec::new(), Vec::new(), (false, true), &corrid);
        assert_eq!(&t[0].data[..], &0i32.to_le_bytes());
        assert_eq!(&t[1].data[..4], &0f32.to_le_bytes());
    }

    #[test]
    fn ids_convert_only_where_they_fit() {
        let big = SequenceId::Number(u64::MAX);
        assert!(InputLayout::corrid(DataType::Uint64, &big).is_some());
        assert!(InputLayout::corrid(DataType::Int64, &big).is_none());
        assert!(InputLayout::corrid(DataType::Int32, &SequenceId::Number(7)).is_some());
        let text = SequenceId::Text("abc".into());
        assert!(InputLayout::corrid(DataType::Uint64, &text).is_none());
        assert_eq!(
            &InputLayout::corrid(DataType::Bytes, &text).unwrap()[..],
            &[3, 0, 0, 0, b'a', b'b', b'c']
        );
        assert!(InputLayout::control(Control::Start, DataType::Bytes).is_none());
        assert!(InputLayout::control(Control::CorrId, DataType::Fp32).is_none());
        assert_eq!(scalar_bytes(DataType::Bool, 2.0), None);
        assert_eq!(scalar_bytes(DataType::Uint8, -1.0), None);
    }
}
