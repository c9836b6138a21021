//! CTC decoding of the recognizer's per-step character probabilities with
//! PP-OCR's character dictionary, as rapidocr's `CTCLabelDecode`: the best
//! class of each step, repeats merged, the blank (class 0) dropped; the
//! confidence is the mean probability of the kept steps (0 when none).

/// The recognizer's classes: `blank`, the dictionary's characters, then a space.
#[derive(Debug, Clone)]
pub struct Dictionary {
    classes: Vec<String>,
}

impl Dictionary {
    /// From the dictionary's text, one character a line (rapidocr reads it from
    /// the recognizer's `character` metadata, split into lines).
    pub fn from_text(text: &str) -> Dictionary {
        let mut classes = vec![String::new()];
        classes.extend(text.lines().map(str::to_owned));
        classes.push(" ".to_owned());
        Dictionary { classes }
    }

    /// The number of classes (the recognizer's last dimension).
    pub fn len(&self) -> usize {
        self.classes.len()
    }

    /// Whether it holds no character.
    pub fn is_empty(&self) -> bool {
        self.classes.len() <= 2
    }

    /// Decodes one line: `probs` is `steps × self.len()`.
    pub fn decode(&self, probs: &[f32]) -> (String, f32) {
        let n = self.classes.len();
        let mut text = String::new();
        let mut confidence = Vec::new();
        let mut previous = None;
        for step in probs.chunks_exact(n) {
            let (best, p) =
                step.iter().enumerate().fold(
                    (0, f32::MIN),
                    |(bi, bp), (i, &p)| if p > bp { (i, p) } else { (bi, bp) },
                );
            if best != 0 && previous != Some(best) {
                text.push_str(&self.classes[best]);
                confidence.push(p);
            }
            previous = Some(best);
        }
        let score = if confidence.is_empty() {
            0.0
        } else {
            (confidence.iter().map(|&p| p as f64).sum::<f64>() / confidence.len() as f64) as f32
        };
        (text, score)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_repeats_and_drops_blanks() {
        let d = Dictionary::from_text("a\nb");
        assert_eq!(d.len(), 4); // blank, a, b, space
        let step = |class: usize, p: f32| {
            let mut v = vec![0.0; 4];
            v[class] = p;
            v
        };
        let probs: Vec<f32> = [
            step(1, 0.9),
            step(1, 0.8),
            step(0, 0.99),
            step(1, 0.7),
            step(3, 0.6),
            step(2, 0.5),
        ]
        .concat();
        let (text, score) = d.decode(&probs);
        assert_eq!(text, "aa b");
        assert!((score - (0.9 + 0.7 + 0.6 + 0.5) / 4.0).abs() < 1e-6);
        assert_eq!(d.decode(&step(0, 1.0)), (String::new(), 0.0));
    }
}
