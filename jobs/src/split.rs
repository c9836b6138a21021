//! Splitting a job submission into its requests as the body arrives, without
//! holding it whole: one KServe v2 request (a JSON object), a JSON array of them,
//! or JSON lines (objects one after another, each usually on its own line; an
//! object may span lines, so a pretty-printed single request works too).
//!
//! The splitter tracks only nesting depth and whether it is inside a string; the
//! bytes of the request being read are kept, up to `max_request` (beyond: an
//! error naming the request). Each complete request goes to the caller, which
//! parses and validates it.

/// Why a submission cannot be split.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// The body's shape is wrong at request `index` (0-based).
    #[error("request {index}: {reason}")]
    At { index: usize, reason: String },
    /// The body as a whole is wrong.
    #[error("{0}")]
    Body(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Nothing but whitespace seen yet.
    Start,
    /// Inside `[ ... ]`; `comma`: a request just ended, a `,` or `]` comes next.
    Array { comma: bool },
    /// After the array's `]`.
    ArrayDone,
    /// Objects one after another (JSON lines, or one request).
    Sequence,
}

/// What gets each request: its index and bytes.
pub type OnRequest<'a, E> = dyn FnMut(usize, &[u8]) -> Result<(), E> + 'a;

/// The incremental splitter.
pub struct Splitter {
    max_request: usize,
    mode: Mode,
    /// The request being read (empty between requests).
    current: Vec<u8>,
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// Requests ended so far (the index of the next).
    count: usize,
}

impl Splitter {
    /// A splitter refusing any request longer than `max_request` bytes.
    pub fn new(max_request: usize) -> Splitter {
        Splitter {
            max_request,
            mode: Mode::Start,
            current: Vec::new(),
            depth: 0,
            in_string: false,
            escaped: false,
            count: 0,
        }
    }

    fn at(&self, reason: impl Into<String>) -> SplitError {
        SplitError::At {
            index: self.count,
            reason: reason.into(),
        }
    }

    /// Feeds the next bytes of the body; `request(index, bytes)` gets each request
    /// that ends in them (its error stops the split and is returned).
    pub fn push<E: From<SplitError>>(
        &mut self,
        chunk: &[u8],
        request: &mut OnRequest<'_, E>,
    ) -> Result<(), E> {
        for &b in chunk {
            if self.depth > 0 {
                self.in_request(b, request)?;
                continue;
            }
            if b.is_ascii_whitespace() {
                continue;
            }
            match (self.mode, b) {
                (Mode::Start, b'[') => self.mode = Mode::Array { comma: false },
                (Mode::Start, b'{') => {
                    self.mode = Mode::Sequence;
                    self.in_request(b, request)?;
                }
                (Mode::Sequence, b'{') | (Mode::Array { comma: false }, b'{') => {
                    self.in_request(b, request)?;
                }
                (Mode::Array { comma: true }, b',') => self.mode = Mode::Array { comma: false },
                (Mode::Array { comma: true }, b']') => self.mode = Mode::ArrayDone,
                (Mode::Array { comma: false }, b']') if self.count == 0 => {
                    self.mode = Mode::ArrayDone
                }
                (Mode::Array { comma: true }, _) => {
                    return Err(self.at("expected `,` or `]` after the previous request").into())
                }
                (Mode::ArrayDone, _) => {
                    return Err(SplitError::Body("text after the array's closing `]`".into()).into())
                }
                (Mode::Start, _) => {
                    return Err(SplitError::Body(
                        "expected a KServe v2 request (a JSON object), a JSON array of them, or JSON lines"
                            .into(),
                    )
                    .into())
                }
                _ => return Err(self.at("expected a JSON object").into()),
            }
        }
        Ok(())
    }

    /// One byte of a request (`depth > 0`, or its opening `{`).
    fn in_request<E: From<SplitError>>(
        &mut self,
        b: u8,
        request: &mut OnRequest<'_, E>,
    ) -> Result<(), E> {
        if self.current.len() >= self.max_request {
            return Err(self
                .at(format!(
                    "longer than the limit of {} bytes",
                    self.max_request
                ))
                .into());
        }
        self.current.push(b);
        if self.in_string {
            match (self.escaped, b) {
                (true, _) => self.escaped = false,
                (false, b'\\') => self.escaped = true,
                (false, b'"') => self.in_string = false,
                _ => {}
            }
            return Ok(());
        }
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' => self.depth += 1,
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                if self.depth == 0 {
                    request(self.count, &self.current)?;
                    self.current.clear();
                    self.count += 1;
                    if let Mode::Array { .. } = self.mode {
                        self.mode = Mode::Array { comma: true };
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The body ended: how many requests it held (an error when it ended inside
    /// one, before its array closed, or held none).
    pub fn finish(self) -> Result<usize, SplitError> {
        if self.depth > 0 {
            return Err(self.at("the body ends inside it"));
        }
        match self.mode {
            Mode::Array { .. } => Err(SplitError::Body("the array is not closed".into())),
            _ if self.count == 0 => Err(SplitError::Body("the body holds no request".into())),
            _ => Ok(self.count),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(body: &str, chunk: usize, max: usize) -> Result<Vec<String>, SplitError> {
        let mut s = Splitter::new(max);
        let mut out = Vec::new();
        for piece in body.as_bytes().chunks(chunk.max(1)) {
            s.push::<SplitError>(piece, &mut |i, bytes| {
                assert_eq!(i, out.len());
                out.push(String::from_utf8_lossy(bytes).into_owned());
                Ok(())
            })?;
        }
        s.finish()?;
        Ok(out)
    }

    #[test]
    fn one_object_an_array_and_lines() {
        for chunk in [1, 3, 1000] {
            assert_eq!(
                split(" {\"a\": {\"b\": \"}\"}}\n", chunk, 100).unwrap(),
                ["{\"a\": {\"b\": \"}\"}}"]
            );
            assert_eq!(
                split("[{\"x\":[1,2]}, {\"y\":\"\\\"]\"}]", chunk, 100).unwrap(),
                ["{\"x\":[1,2]}", "{\"y\":\"\\\"]\"}"]
            );
            assert_eq!(
                split("{\"n\":1}\n{\"n\":2}\n\n{\n\"n\":3}", chunk, 100)
                    .unwrap()
                    .len(),
                3
            );
        }
    }

    #[test]
    fn bad_shapes_name_the_request() {
        assert_eq!(
            split("[{\"a\":1} {\"b\":2}]", 4, 100),
            Err(SplitError::At {
                index: 1,
                reason: "expected `,` or `]` after the previous request".into()
            })
        );
        assert!(matches!(
            split("[{\"a\":1}, 3]", 4, 100),
            Err(SplitError::At { index: 1, .. })
        ));
        assert!(matches!(
            split("{\"a\":1}{\"b\":", 4, 100),
            Err(SplitError::At { index: 1, .. })
        ));
        assert!(matches!(
            split("[{\"a\":1}", 4, 100),
            Err(SplitError::Body(_))
        ));
        assert!(matches!(split("", 4, 100), Err(SplitError::Body(_))));
        assert!(matches!(split("[]", 4, 100), Err(SplitError::Body(_))));
        assert!(matches!(split("[{}] x", 4, 100), Err(SplitError::Body(_))));
        assert!(matches!(split("42", 4, 100), Err(SplitError::Body(_))));
    }

    #[test]
    fn a_request_past_the_limit_is_refused() {
        assert_eq!(
            split("{\"a\":1}\n{\"b\":\"0123456789\"}", 5, 12),
            Err(SplitError::At {
                index: 1,
                reason: "longer than the limit of 12 bytes".into()
            })
        );
    }
}
