//! The docs' links resolve: every relative link in `README.md` and `docs/*.md`
//! names a file that exists, and its `#anchor`, if any, a heading of that file
//! (GitHub's anchors: the heading's text lower-cased, punctuation dropped, spaces
//! as hyphens, a repeated heading numbered `-1`, `-2`, …). Links inside fenced
//! code blocks and links with a scheme (`https:`, `mailto:`) are not checked.

#![allow(clippy::unwrap_used)] // helpers of tests: a failure is the test failing

use std::collections::HashSet;
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The text of `markdown` outside fenced code blocks, line by line.
fn prose(markdown: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    markdown.lines().filter(move |line| {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// GitHub's anchor for a heading's text.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of every heading of `markdown`.
fn anchors(markdown: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    for line in prose(markdown) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(&line[hashes..]);
        let mut anchor = base.clone();
        let mut n = 0;
        while !seen.insert(anchor.clone()) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
    }
    seen
}

/// The targets of the inline links (`[text](target)`) of `markdown`.
fn links(markdown: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in prose(markdown) {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find([')', ' ']).unwrap_or(rest.len());
            found.push(rest[..end].to_owned());
            rest = &rest[end..];
        }
    }
    found
}

/// Every broken link of `file`, as `file: target: why` (`file` relative to `root`).
fn broken_links(root: &Path, file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).unwrap();
    let name = file.strip_prefix(root).unwrap_or(file).display();
    let mut broken = Vec::new();
    for target in links(&text) {
        let scheme = target
            .split_once(':')
            .is_some_and(|(s, _)| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphabetic()));
        if scheme {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((path, anchor)) => (path, Some(anchor)),
            None => (target.as_str(), None),
        };
        let resolved = if path.is_empty() {
            file.to_path_buf()
        } else {
            file.parent().unwrap().join(path)
        };
        if !resolved.exists() {
            broken.push(format!("{name}: {target}: no such file"));
            continue;
        }
        let is_markdown = resolved.extension().is_some_and(|e| e == "md");
        if let (Some(anchor), true) = (anchor, is_markdown) {
            let headings = anchors(&std::fs::read_to_string(&resolved).unwrap());
            if !headings.contains(anchor) {
                broken.push(format!("{name}: {target}: no such heading"));
            }
        }
    }
    broken
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let root = workspace();
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    assert!(files.len() > 5, "{files:?}");
    let broken: Vec<String> = files.iter().flat_map(|f| broken_links(&root, f)).collect();
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_are_githubs() {
    let text = "# kiln\n## The `cuda` backend (`buffers/src/cuda/`, feature `cuda`)\n\
                ```\n# not a heading\n```\n## Logging\n## Logging\n";
    let found = anchors(text);
    for anchor in [
        "kiln",
        "the-cuda-backend-bufferssrccuda-feature-cuda",
        "logging",
        "logging-1",
    ] {
        assert!(found.contains(anchor), "{anchor}: {found:?}");
    }
    assert!(!found.contains("not-a-heading"), "{found:?}");
    assert_eq!(
        links("see [a](a.md#x) and [b](https://x) `[c](c.md)`\n```\n[d](d.md)\n```"),
        ["a.md#x", "https://x", "c.md"]
    );
}
