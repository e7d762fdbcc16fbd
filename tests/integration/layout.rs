//! The guide's layout chapter against the tree: it names every source file of the runtime,
//! the macro crate and the binary, and every example, and every file it names exists. A newcomer finds a behaviour's home there; a file added,
//! moved or renamed without the chapter fails here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The runtime's `.rs` files, as paths under `distlock-runtime/src`.
fn runtime_files(dir: &Path, under: &str, into: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().into_string().unwrap();
        let path = format!("{under}{name}");
        if entry.file_type().unwrap().is_dir() {
            runtime_files(&entry.path(), &format!("{path}/"), into);
        } else if name.ends_with(".rs") {
            into.insert(path);
        }
    }
}

/// The runtime's map: the chapter's second `text` block, which lists `distlock-runtime/src`.
fn runtime_map(chapter: &str) -> &str {
    let block = chapter.split("```text").nth(2).expect("the runtime's map");
    block.split("```").next().unwrap()
}

/// Every word of `text` that names a `.rs` file (`mod.rs` of `testing/` is `testing/mod.rs`
/// only where it is spelled so).
fn named_files(text: &str) -> BTreeSet<String> {
    text.split(|c: char| c.is_whitespace() || matches!(c, ',' | '(' | ')' | '`'))
        .filter(|word| word.ends_with(".rs"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_layout_chapter_names_every_runtime_file_and_only_files_that_exist() {
    let chapter = std::fs::read_to_string(root().join("src/guide/layout.md")).unwrap();
    let map = runtime_map(&chapter);
    let src = root().join("distlock-runtime/src");
    let mut files = BTreeSet::new();
    runtime_files(&src, "", &mut files);
    assert!(files.contains("backend/node/acquire.rs"), "{files:?}");

    // The test kit is listed as one room, by its files' names.
    let testing_line = map
        .lines()
        .skip_while(|line| !line.starts_with("testing/"))
        .take(2)
        .collect::<Vec<_>>()
        .join(" ");
    let unnamed: Vec<_> = files
        .iter()
        .filter(|file| match file.strip_prefix("testing/") {
            Some(name) => !named_files(&testing_line).contains(name),
            None => !named_files(map).contains(file.as_str()),
        })
        .collect();
    assert!(unnamed.is_empty(), "not in the layout chapter: {unnamed:?}");

    let missing: Vec<_> = named_files(map)
        .into_iter()
        .filter(|name| !src.join(name).exists() && !src.join("testing").join(name).exists())
        .collect();
    assert!(
        missing.is_empty(),
        "named in the layout chapter, not in the tree: {missing:?}"
    );
}

#[test]
fn every_file_the_glossary_names_exists() {
    let chapter = std::fs::read_to_string(root().join("src/guide/layout.md")).unwrap();
    let words = chapter
        .split("## Words")
        .nth(1)
        .expect("the glossary")
        .split("\n## ")
        .next()
        .unwrap();
    let src = root().join("distlock-runtime/src");
    let named: Vec<String> = words
        .lines()
        .filter_map(|row| row.rsplit('|').nth(1))
        .flat_map(|owners| {
            owners
                .split('`')
                .skip(1)
                .step_by(2)
                .filter(|name| name.ends_with(".rs") || name.ends_with('/'))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(named.len() > 20, "{named:?}");
    let missing: Vec<_> = named
        .iter()
        .filter(|name| !src.join(name).exists())
        .collect();
    assert!(
        missing.is_empty(),
        "the glossary names what is not in the tree: {missing:?}"
    );
}

#[test]
fn the_layout_chapter_names_every_file_of_the_macros_and_the_binary_and_every_example() {
    let chapter = std::fs::read_to_string(root().join("src/guide/layout.md")).unwrap();
    let map = chapter
        .split("```text")
        .nth(1)
        .expect("the repository's map");
    let map = map.split("```").next().unwrap();
    let section = |start: &str| -> String {
        let mut lines = map.lines().skip_while(|line| !line.starts_with(start));
        let first = lines.next().unwrap_or_default().to_owned();
        let rest = lines.take_while(|line| line.starts_with(' '));
        std::iter::once(first)
            .chain(rest.map(str::to_owned))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let words = |text: &str| -> BTreeSet<String> {
        text.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.'))
            .map(str::to_owned)
            .collect()
    };
    let files_of = |dir: &str| -> Vec<String> {
        let mut files: Vec<String> = std::fs::read_dir(root().join(dir))
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .filter(|name| name.ends_with(".rs"))
            .collect();
        files.sort();
        files
    };
    let mut unnamed = Vec::new();
    for (dir, start) in [
        ("distlock-macros/src", "distlock-macros/"),
        ("src/bin/distlock", "src/bin/distlock/"),
    ] {
        let named = words(&section(start));
        for file in files_of(dir) {
            if file != "lib.rs" && !named.contains(&file) {
                unnamed.push(format!("{dir}/{file}"));
            }
        }
    }
    let examples = words(&section("examples/"));
    for file in files_of("examples") {
        let name = file.trim_end_matches(".rs");
        if !examples.contains(name) {
            unnamed.push(format!("examples/{file}"));
        }
    }
    assert!(unnamed.is_empty(), "not in the layout chapter: {unnamed:?}");
}
