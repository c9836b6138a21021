//! W3C Trace Context: the `traceparent` and `tracestate` a caller sends (HTTP
//! headers, gRPC metadata), parsed into the parent of the request's span.

use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

/// The W3C headers of a request, as its ingress found them (HTTP header or gRPC
/// metadata, both lower case). Taken only while tracing is on.
#[derive(Debug, Default, Clone)]
pub struct Propagated {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

impl Propagated {
    /// The `traceparent` and `tracestate` a transport's headers carry, read through
    /// `header` (a header's value as text, if present and readable).
    pub fn from_headers<'a>(header: impl Fn(&str) -> Option<&'a str>) -> Propagated {
        Propagated {
            traceparent: header("traceparent").map(str::to_owned),
            tracestate: header("tracestate").map(str::to_owned),
        }
    }
}

/// The caller's span a request's span joins: `None` when `traceparent` is absent
/// or malformed (as the W3C says, a bad header starts a new trace, it fails
/// nothing). A malformed `tracestate` is dropped alone.
pub fn parent(propagated: &Propagated) -> Option<SpanContext> {
    let header = propagated.traceparent.as_deref()?.trim();
    let mut parts = header.split('-');
    let version = parts.next()?;
    let (trace_id, span_id, flags) = (parts.next()?, parts.next()?, parts.next()?);
    // Version 00 has exactly four fields; a later version may append more.
    if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    u8::from_str_radix(version, 16).ok()?;
    let trace_id = hex_id::<16>(trace_id).map(TraceId::from_bytes)?;
    let span_id = hex_id::<8>(span_id).map(SpanId::from_bytes)?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID || flags.len() != 2 {
        return None;
    }
    let flags = TraceFlags::new(u8::from_str_radix(flags, 16).ok()?);
    let state = propagated
        .tracestate
        .as_deref()
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    Some(SpanContext::new(trace_id, span_id, flags, true, state))
}

/// `N` bytes from exactly `2N` lower-case hex digits.
fn hex_id<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N
        || !s
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(traceparent: &str) -> Option<SpanContext> {
        parent(&Propagated {
            traceparent: Some(traceparent.into()),
            tracestate: Some("vendor=x,other=y".into()),
        })
    }

    #[test]
    fn parses_the_w3c_example() {
        let sc = of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(
            sc.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(sc.span_id(), SpanId::from_hex("00f067aa0ba902b7").unwrap());
        assert!(sc.is_sampled() && sc.is_remote());
        assert_eq!(sc.trace_state().get("vendor"), Some("x"));
    }

    #[test]
    fn refuses_malformed_headers() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert!(of(bad).is_none(), "{bad}");
        }
        // A later version may carry more fields.
        assert!(of("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz").is_some());
    }
}
