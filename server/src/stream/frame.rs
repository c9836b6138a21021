//! One frame's way through kiln: decoded and pre-processed on actix's blocking
//! pool, then the core's one inference path (a [`Call`]) as REST and gRPC take
//! it, then post-processed and encoded on the blocking pool again, the call
//! ended with the outcome (a frame that cannot be encoded is logged and counted a
//! failure, as a REST answer that cannot be). The session runs up to
//! `max_inflight_frames` of these at once and sends their results in order.
//!
//! Off the I/O thread because each step is milliseconds: decoding a 640×480 JPEG
//! and encoding the inverted one take several each, where the connection's thread
//! serves every other connection it holds (`http/offload.rs` has the hop's cost,
//! 2.4 µs, about a thousandth of the work).

use std::sync::Arc;
use std::time::Instant;

use actix_web::web;
use bytes::Bytes;
use kiln_protocol::{InferRequest, OutputTensor};

use kiln_core::memory::client_bytes::{Exhausted, Reservation};
use kiln_core::observe::stream_metrics::DropReason;

use super::held::hold;
use super::image::{self, DecodeError, Rgb};
use super::processing::{FrameData, FrameInfo};
use super::protocol::{self, Encoding, Open};
use super::result::{self, EncodeError, EncodedOutputs, ResultLimit};
use kiln_core::error::ServerError;
use kiln_core::models::Served;
use kiln_core::observe::trace::Trace;
use kiln_core::request::serve::Call;

/// A frame as it arrives, with the budget's bytes it holds.
pub(super) enum Raw {
    /// A binary message from the client, decoded as the session's `encoding` says.
    Encoded(Bytes, Reservation),
    /// A frame a server-side source decoded.
    Decoded(Rgb, Reservation),
}

/// A frame taken in: its number, when it arrived, its data.
pub(super) struct Incoming {
    pub index: u64,
    pub arrived: Instant,
    pub raw: Raw,
}

/// What the session needs of a frame once it is through.
pub(super) struct Done {
    pub index: u64,
    pub arrived: Instant,
    pub outcome: Result<EncodedFrame, Failed>,
}

/// A frame answered: its encoded outputs and the decoded frame's size.
pub(super) struct EncodedFrame {
    pub encoded: EncodedOutputs,
    pub size: Option<(usize, usize)>,
}

/// A frame that failed: why, and whether it counts as dropped (`rejected`: the
/// model's queue refused it; `memory`: the client-bytes budget had no room).
pub(super) struct Failed {
    pub error: String,
    pub dropped: Option<DropReason>,
}

/// What every frame of a session shares.
pub(super) struct FrameContext {
    pub group: Served,
    pub open: Arc<Open>,
    /// The model batches: its inputs and outputs have a batch dimension of 1.
    pub batched: bool,
    /// The bound on a result, and the budget frames and results reserve from.
    pub limit: ResultLimit,
}

/// Takes `frame` through decoding, the model and encoding.
pub(super) async fn run(ctx: Arc<FrameContext>, frame: Incoming) -> Done {
    let (index, arrived) = (frame.index, frame.arrived);
    Done {
        index,
        arrived,
        outcome: infer(ctx, frame).await,
    }
}

async fn infer(ctx: Arc<FrameContext>, frame: Incoming) -> Result<EncodedFrame, Failed> {
    let index = frame.index;
    let failed = |e: ServerError| Failed {
        dropped: matches!(e, ServerError::QueueFull { .. } | ServerError::Exhausted(_))
            .then_some(DropReason::Rejected),
        error: format!("frame {index}: {e}"),
    };
    let memory = |e: Exhausted| Failed {
        dropped: Some(DropReason::Memory),
        error: format!("frame {index}: {e}"),
    };
    let prepare = {
        let ctx = Arc::clone(&ctx);
        move || prepare(&ctx, frame)
    };
    let decoded = match blocking(prepare).await {
        Ok(Ok(decoded)) => Ok(decoded),
        Ok(Err(DecodeError::Invalid(e))) => Err(ServerError::InvalidRequest(e)),
        Ok(Err(DecodeError::Exhausted(e))) => return Err(memory(e)),
        Err(e) => Err(e),
    };
    let trace = Trace::receive(Default::default);
    let answer = match Call::start(ctx.group.clone(), decoded, trace) {
        Ok((mut call, info)) => call.answer().await.map(|response| (call, response, info)),
        Err(e) => Err(e),
    };
    let (call, response, info) = answer.map_err(failed)?;
    let size = info.size;
    let encode = {
        let ctx = Arc::clone(&ctx);
        move || finish(&ctx, response.outputs, &info)
    };
    // The budget's refusal, kept apart: the frame is then dropped for memory.
    let mut exhausted = None;
    let encoded = match blocking(encode).await {
        Ok(Ok(encoded)) => Ok(encoded),
        Ok(Err(EncodeError::Exhausted(e))) => Err(ServerError::from(exhausted.insert(e).clone())),
        Ok(Err(e)) => Err(ServerError::Internal(e.message(ctx.limit.max_bytes))),
        Err(e) => Err(e),
    };
    match call.end(encoded) {
        Ok(encoded) => Ok(EncodedFrame { encoded, size }),
        Err(e) => Err(match exhausted {
            Some(exhausted) => memory(exhausted),
            None => Failed {
                dropped: None,
                error: format!("frame {index}: {e}"),
            },
        }),
    }
}

/// Decodes and pre-processes a frame into the model's request. A picture's
/// pixels are reserved from the budget before they are decoded, and the input
/// tensor's bytes keep the reservation for as long as they live (in the model's
/// queue, until the batch has copied them).
fn prepare(ctx: &FrameContext, frame: Incoming) -> Result<(InferRequest, FrameInfo), DecodeError> {
    let budget = &ctx.limit.budget;
    let (data, mut held) = match frame.raw {
        Raw::Decoded(rgb, held) => (FrameData::Image(rgb), held),
        Raw::Encoded(bytes, held) => match ctx.open.encoding {
            Encoding::Jpeg => {
                let (rgb, pixels) = image::decode_jpeg(&bytes, budget)?;
                (FrameData::Image(rgb), pixels)
            }
            Encoding::Png => {
                let (rgb, pixels) = image::decode_png(&bytes, budget)?;
                (FrameData::Image(rgb), pixels)
            }
            Encoding::Raw => {
                let (dtype, shape, data) =
                    protocol::parse_raw(&bytes).map_err(DecodeError::Invalid)?;
                // The tensor is a slice of the message: its reservation goes along.
                (FrameData::Tensor { dtype, shape, data }, held)
            }
        },
    };
    let size = data.size();
    // Processing may make a tensor of another size (text_boxes: FP32, resized),
    // allocated while the frame lives: reserved before, trimmed to it after.
    held.grow_by(ctx.open.processing.new_bytes(&data))?;
    let mut input = ctx
        .open
        .processing
        .pre(data, &ctx.open.input)
        .map_err(DecodeError::Invalid)?;
    let len = input.data.len();
    held.grow_to(len)?;
    held.shrink_to(len);
    input.data = hold(input.data, Some(held), None);
    let info = FrameInfo {
        size,
        input_shape: input.shape.clone(),
    };
    if ctx.batched {
        input.shape.insert(0, 1);
    }
    let request = InferRequest {
        model: ctx.group.endpoint().to_owned(),
        id: Some(format!("{}/{}", ctx.open.key, frame.index)),
        inputs: vec![input],
        outputs: ctx.open.outputs.clone(),
        parameters: ctx.open.parameters.clone(),
    };
    Ok((request, info))
}

/// Post-processes and encodes a frame's outputs.
fn finish(
    ctx: &FrameContext,
    mut outputs: Vec<OutputTensor>,
    info: &FrameInfo,
) -> Result<EncodedOutputs, EncodeError> {
    if ctx.batched {
        for output in &mut outputs {
            if output.shape.first() == Some(&1) {
                output.shape.remove(0);
            }
        }
    }
    let processed = ctx
        .open
        .processing
        .post(outputs, info)
        .map_err(EncodeError::Failed)?;
    result::encode_outputs(processed, &ctx.open, &ctx.limit)
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ServerError> {
    web::block(work)
        .await
        .map_err(|e| ServerError::Internal(format!("a blocking task failed: {e}")))
}
