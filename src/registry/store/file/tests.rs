use super::*;
use proptest::prelude::*;
use std::fs::OpenOptions;

fn writer(path: &Path) -> File {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap()
}

fn lines(batch: &Batch) -> Vec<&[u8]> {
    batch.lines.iter().map(Vec::as_slice).collect()
}

#[test]
fn lines_once_partial_waits_rotation_and_truncation_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j");
    let store = FileStore::new(path.clone(), false);
    let read = || store.inner.read_new().unwrap();
    assert_eq!(
        read(),
        Batch::default(),
        "missing file: empty, generation 0"
    );
    let mut f = writer(&path);
    f.write_all(b"one\ntw").unwrap();
    let batch = read();
    assert!(
        batch.restarted,
        "the first read of a file starts generation 1"
    );
    assert_eq!(lines(&batch), [b"one"]);
    assert_eq!(
        batch.position,
        Position {
            generation: 1,
            offset: 4
        },
        "after the last complete line, not the partial one"
    );
    let batch = read();
    assert!(batch.lines.is_empty(), "a partial line waits");
    assert!(!batch.restarted);
    f.write_all(b"o\nthree\n").unwrap();
    let batch = read();
    assert_eq!(lines(&batch), [&b"two"[..], b"three"]);
    assert_eq!(batch.position.offset, 14);
    assert!(read().lines.is_empty(), "each line once");

    // Rotation: the old file moves away, a new one takes its name.
    std::fs::rename(&path, dir.path().join("j.1")).unwrap();
    std::fs::write(&path, b"fresh\n").unwrap();
    let batch = read();
    assert!(batch.restarted);
    assert_eq!(lines(&batch), [b"fresh"]);
    assert_eq!(
        batch.position,
        Position {
            generation: 2,
            offset: 6
        }
    );
    // Truncation in place.
    std::fs::write(&path, b"").unwrap();
    let mut f = writer(&path);
    let batch = read();
    assert!(batch.restarted && batch.lines.is_empty());
    assert_eq!(batch.position.generation, 3);
    f.write_all(b"again\n").unwrap();
    let batch = read();
    assert!(!batch.restarted);
    assert_eq!(lines(&batch), [b"again"]);
}

/// Truncated and rewritten past the old length (or to the same length) within one poll: the
/// inode and a length check alone would read on from the old offset and miss the rewritten
/// lines. The kept first bytes, or the bytes before the offset, no longer match: read again.
#[test]
fn a_file_truncated_and_rewritten_within_one_poll_is_read_from_its_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j");
    let store = FileStore::new(path.clone(), false);
    let read = || store.inner.read_new().unwrap();
    let rewrite = |bytes: &[u8]| {
        // In place: same inode, as `truncate` then writes would leave it.
        let mut f = OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.write_all(bytes).unwrap();
    };
    std::fs::write(&path, b"one\ntwo\n").unwrap();
    assert_eq!(lines(&read()), [&b"one"[..], b"two"]);

    // Longer than before: the first bytes differ.
    rewrite(b"uno\ndos\ntres\n");
    let batch = read();
    assert!(batch.restarted, "a rewrite starts a new generation");
    assert_eq!(lines(&batch), [&b"uno"[..], b"dos", b"tres"]);
    assert_eq!(
        batch.position,
        Position {
            generation: 2,
            offset: 13
        }
    );

    // Same length, same first bytes: the bytes before our offset differ.
    let long = vec![b'g'; 300];
    let mut before = long.clone();
    before.extend_from_slice(b"\nrevoked-a\n");
    rewrite(&before);
    assert_eq!(read().lines.len(), 2);
    let mut after = long.clone();
    after.extend_from_slice(b"\nrevoked-b\nstopped-c\n");
    rewrite(&after);
    let batch = read();
    assert!(batch.restarted);
    assert_eq!(lines(&batch), [&long[..], b"revoked-b", b"stopped-c"]);
    assert_eq!(batch.position.generation, 4);

    // Plain appends still read on, once.
    writer(&path).write_all(b"more\n").unwrap();
    let batch = read();
    assert!(!batch.restarted);
    assert_eq!(lines(&batch), [b"more"]);
    assert!(read().lines.is_empty());
}

#[test]
fn an_append_after_a_torn_line_starts_with_a_newline() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j");
    std::fs::write(&path, b"{\"torn").unwrap();
    let record = serde_json::json!({"event": "x"});
    let first = append(&path, &record, true).unwrap();
    assert_eq!((first.start, first.end), (7, 21));
    let second = append(&path, &record, false).unwrap();
    assert_eq!((second.start, second.end), (21, 35));
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"{\"torn\n{\"event\":\"x\"}\n{\"event\":\"x\"}\n"
    );
}

#[tokio::test]
async fn an_append_returns_a_position_the_reader_reaches() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j");
    let store = FileStore::new(path.clone(), true);
    assert!(store.read_new().await.unwrap().lines.is_empty());
    let record = serde_json::json!({"n": 1});
    // The file does not exist yet: our append starts the reader's next generation.
    let at = store.append(&record).await.unwrap();
    assert_eq!(
        at,
        Position {
            generation: 1,
            offset: 8
        }
    );
    // Another writer appends after us; the reader reaches our line and beyond.
    writer(&path).write_all(b"other\n").unwrap();
    let batch = store.read_new().await.unwrap();
    assert_eq!(lines(&batch), [&b"{\"n\":1}"[..], b"other"]);
    assert!(batch.position >= at);

    let at = store.append(&serde_json::json!({"n": 2})).await.unwrap();
    assert_eq!(
        at,
        Position {
            generation: 1,
            offset: 22
        }
    );
    assert!(store.read_new().await.unwrap().position >= at);

    // Rotated away before our append: the position is in the next generation, which only a
    // read of the new file reaches.
    std::fs::rename(&path, dir.path().join("j.1")).unwrap();
    let at = store.append(&serde_json::json!({"n": 3})).await.unwrap();
    assert_eq!(at.generation, 2);
    let batch = store.read_new().await.unwrap();
    assert!(batch.restarted);
    assert_eq!(lines(&batch), [b"{\"n\":3}"]);
    assert!(batch.position >= at);
    assert_eq!(store.describe(), format!("journal {}", path.display()));
}

#[tokio::test]
async fn a_dropped_read_loses_no_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j");
    std::fs::write(&path, b"one\n").unwrap();
    let store = FileStore::new(path.clone(), false);
    // Polled once (its blocking read starts), then dropped.
    let mut lines = match tokio::time::timeout(Duration::ZERO, store.read_new()).await {
        Ok(finished) => finished.unwrap().lines, // finished within one poll: nothing to drop
        Err(_) => Vec::new(),
    };
    writer(&path).write_all(b"two\n").unwrap();
    // The dropped read's lines wait for this one, or its blocking task still holds the cursor
    // and this read comes after it: either way one read hands out the rest.
    lines.extend(store.read_new().await.unwrap().lines);
    assert_eq!(lines, [b"one".to_vec(), b"two".to_vec()]);
}

/// A compaction swapped in: the store reads what it had not read of the old file, then goes on
/// in the new one after what it covers; nothing is handed out twice, and a line appended
/// between the compaction's read and its swap is in the new file. A later plain rotation, which
/// the note does not describe, is read from its start.
#[test]
fn a_compaction_is_followed_without_reading_anything_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j");
    let store = FileStore::new(path.clone(), false);
    let mut f = writer(&path);
    f.write_all(b"a\nb\nc\n").unwrap();
    assert_eq!(lines(&store.inner.read_new().unwrap()), [b"a", b"b", b"c"]);
    f.write_all(b"d\n").unwrap();
    let read = swap::read(&path).unwrap();
    f.write_all(b"e\n").unwrap();
    let kept = [&b"b"[..], b"d"];
    let swapped = swap::swap_in(&path, &read, kept.into_iter(), "stamp").unwrap();
    assert_eq!(swapped.appended_meanwhile, 1);
    assert_eq!(std::fs::read(&path).unwrap(), b"b\nd\ne\n");
    assert_eq!(std::fs::read(&swapped.archive).unwrap(), b"a\nb\nc\nd\ne\n");
    assert_eq!(swapped.archive, dir.path().join("j.stamp"));
    // Appended to the new file before the store noticed the swap: already its next generation.
    let appended = store.inner.append(b"f".to_vec()).unwrap();
    assert_eq!(
        appended,
        Position {
            generation: 2,
            offset: 8
        }
    );
    let batch = store.inner.read_new().unwrap();
    assert!(!batch.restarted, "a compaction is not a restart");
    assert_eq!(lines(&batch), [b"d", b"e", b"f"]);
    assert_eq!(batch.position, appended);
    assert!(store.inner.read_new().unwrap().lines.is_empty());
    assert!(
        matches!(
            swap::swap_in(&path, &read, kept.into_iter(), "again"),
            Err(swap::SwapError::Changed { .. })
        ),
        "a read of a file since replaced is not swapped in"
    );

    std::fs::rename(&path, dir.path().join("j.1")).unwrap();
    std::fs::write(&path, b"z\n").unwrap();
    let batch = store.inner.read_new().unwrap();
    assert!(
        batch.restarted,
        "a rotation the note does not describe starts over"
    );
    assert_eq!(lines(&batch), [b"z"]);
}

/// Appends from another thread while compactions read, choose and swap: every line is in
/// the new file exactly once, in order (the swap copies what came after its read, and an append
/// waits for the swap and then goes to the new file).
#[test]
fn no_append_is_lost_to_a_compaction() {
    const LINES: usize = 2000;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j");
    append(&path, &serde_json::json!(0), false).unwrap();
    let writer = {
        let path = path.clone();
        std::thread::spawn(move || {
            for i in 1..LINES {
                append(&path, &serde_json::json!(i), false).unwrap();
            }
        })
    };
    for round in 0.. {
        let read = swap::read(&path).unwrap();
        let (kept, _) = crate::registry::journal::split_lines(&read.bytes);
        match swap::swap_in(&path, &read, kept, &format!("{round}")) {
            Ok(_) | Err(swap::SwapError::Changed { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        if writer.is_finished() {
            break;
        }
        // A compaction a millisecond, still thousands of times what anyone runs: back to back,
        // a loaded machine can starve the appender's open-then-lock past its retries.
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    writer.join().unwrap();
    let expected: String = (0..LINES).map(|i| format!("{i}\n")).collect();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), expected);
}

#[test]
fn a_line_longer_than_the_cap_is_skipped_to_its_newline_and_counted_once() {
    const CAP: usize = 64;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j");
    let store = FileStore::limited(path.clone(), false, CAP);
    let read = || store.inner.read_new().unwrap();
    let mut f = writer(&path);
    let exact = vec![b'e'; CAP];
    let long = vec![b'x'; CAP + 1];
    f.write_all(&[&b"one\n"[..], &long, b"\n", &exact, b"\ntwo\n"].concat())
        .unwrap();
    let batch = read();
    assert_eq!(lines(&batch), [&b"one"[..], &exact, b"two"]);
    assert_eq!(batch.too_long, 1);

    // A torn line grows past the cap over two reads: counted once, when it passes the cap,
    // and from then on nothing of it is held.
    let start = std::fs::metadata(&path).unwrap().len();
    f.write_all(&[b'y'; CAP - 10]).unwrap();
    let batch = read();
    assert_eq!((batch.lines.len(), batch.too_long), (0, 0));
    assert_eq!(store.inner.cursor().partial.len(), CAP - 10);
    f.write_all(&[b'y'; 20]).unwrap();
    let batch = read();
    assert_eq!((batch.lines.len(), batch.too_long), (0, 1));
    assert_eq!(
        batch.position.offset, start,
        "after the last line handed out"
    );
    let held = |store: &FileStore| {
        let cursor = store.inner.cursor();
        (cursor.partial.len(), cursor.partial.capacity())
    };
    assert_eq!(held(&store), (0, 0));
    for _ in 0..3 {
        f.write_all(&[b'y'; 1000]).unwrap();
        let batch = read();
        assert_eq!((batch.lines.len(), batch.too_long), (0, 0), "counted once");
        assert_eq!(held(&store), (0, 0), "nothing of it is held");
        assert_eq!(batch.position.offset, start);
    }
    // Its newline ends it; the lines after it are read.
    f.write_all(b"yy\nthree\nfo").unwrap();
    let batch = read();
    assert_eq!(lines(&batch), [b"three"]);
    assert_eq!(batch.too_long, 0);
    f.write_all(b"ur\n").unwrap();
    assert_eq!(lines(&read()), [b"four"]);
}

/// A torn last line growing read after read is appended to in place: its buffer is
/// reallocated a logarithmic number of times (geometric growth), never copied anew per read.
#[test]
fn a_growing_torn_line_is_not_copied_on_every_read() {
    const READS: usize = 200;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j");
    let store = FileStore::new(path.clone(), false);
    let mut f = writer(&path);
    f.write_all(b"done\n").unwrap();
    let mut moves = 0;
    let mut last = None;
    for _ in 0..READS {
        f.write_all(&[b'z'; 1024]).unwrap();
        let batch = store.inner.read_new().unwrap();
        assert!(batch.lines.len() <= 1);
        let at = store.inner.cursor().partial.as_ptr();
        moves += usize::from(last.is_some_and(|last| last != at));
        last = Some(at);
    }
    assert_eq!(store.inner.cursor().partial.len(), READS * 1024);
    // 1 KiB to 200 KiB by doubling: 8 moves; a copy per read would move it every time.
    assert!(
        moves <= 10,
        "the partial line moved {moves} times in {READS} reads"
    );
    f.write_all(b"\n").unwrap();
    let batch = store.inner.read_new().unwrap();
    assert_eq!(batch.lines, [vec![b'z'; READS * 1024]]);
}

proptest! {
    /// However the bytes of a journal arrive, the tail hands out the same lines up to the cap,
    /// and counts the longer ones once each.
    #[test]
    fn chunking_does_not_change_what_the_cap_skips(
        input in prop::collection::vec(
            prop::collection::vec(any::<u8>().prop_filter("no newline", |b| *b != b'\n'), 0..40),
            0..20,
        ),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
        cap in 0usize..30,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let store = FileStore::limited(path.clone(), false, cap);
        let bytes: Vec<u8> = input.iter().flat_map(|l| l.iter().copied().chain([b'\n'])).collect();
        let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
        cuts.push(bytes.len());
        cuts.sort_unstable();
        let mut f = writer(&path);
        let (mut out, mut from, mut too_long) = (Vec::new(), 0, 0);
        for cut in cuts {
            f.write_all(&bytes[from..cut]).unwrap();
            from = cut;
            let batch = store.inner.read_new().unwrap();
            prop_assert_eq!(batch.position.offset as usize, bytes[..cut].iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1));
            prop_assert!(store.inner.cursor().partial.len() <= cap);
            out.extend(batch.lines);
            too_long += batch.too_long;
        }
        let kept: Vec<Vec<u8>> = input.iter().filter(|l| l.len() <= cap).cloned().collect();
        prop_assert_eq!(out, kept);
        prop_assert_eq!(too_long as usize, input.iter().filter(|l| l.len() > cap).count());
    }

    /// However the bytes of a journal arrive, the tail hands out the same complete lines.
    #[test]
    fn chunking_does_not_change_the_lines(
        input in prop::collection::vec(
            prop::collection::vec(any::<u8>().prop_filter("no newline", |b| *b != b'\n'), 0..40),
            0..20,
        ),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let store = FileStore::new(path.clone(), false);
        let mut bytes = Vec::new();
        for line in &input {
            bytes.extend_from_slice(line);
            bytes.push(b'\n');
        }
        let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
        cuts.push(bytes.len());
        cuts.sort_unstable();
        let mut f = writer(&path);
        let (mut out, mut from) = (Vec::new(), 0);
        for cut in cuts {
            f.write_all(&bytes[from..cut]).unwrap();
            from = cut;
            let batch = store.inner.read_new().unwrap();
            prop_assert_eq!(batch.position.generation, 1);
            prop_assert_eq!(batch.position.offset as usize, bytes[..cut].iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1));
            out.extend(batch.lines);
        }
        prop_assert_eq!(out, input);
    }
}

/// Descriptors of this process open on `path` (or on it deleted).
fn held(path: &Path) -> usize {
    let deleted = format!("{} (deleted)", path.display());
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter(|target| target == path || target.as_os_str() == deleted.as_str())
        .count()
}

/// A poll is a `stat` of the path, not an `open`: the file is held between polls (a process
/// out of descriptors still reads its journal), a replaced file is still noticed by its inode,
/// and a deleted one is let go rather than held, and read, forever.
#[test]
fn the_journal_is_held_open_between_polls_and_let_go_when_its_path_names_another() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("j");
    let store = FileStore::new(path.clone(), false);
    let read = || store.inner.read_new().unwrap();
    let mut f = writer(&path);
    f.write_all(b"one\n").unwrap();
    assert_eq!(lines(&read()), [b"one"]);
    assert_eq!(held(&path), 2, "ours and the writer's");
    for _ in 0..10 {
        assert!(read().lines.is_empty());
    }
    f.write_all(b"two\n").unwrap();
    assert_eq!(lines(&read()), [b"two"]);
    assert_eq!(held(&path), 2, "one descriptor, kept across polls");

    // Replaced: the new file is read from its start, the old one no longer held.
    std::fs::rename(&path, dir.path().join("j.1")).unwrap();
    std::fs::write(&path, b"fresh\n").unwrap();
    let batch = read();
    assert!(batch.restarted);
    assert_eq!(lines(&batch), [b"fresh"]);
    assert_eq!(held(&path), 1, "the new file only");
    f.write_all(b"to the old file\n").unwrap();
    assert!(read().lines.is_empty(), "the old file is not read");

    // Deleted: let go; a line written to it through another descriptor is never read.
    let mut g = writer(&path);
    std::fs::remove_file(&path).unwrap();
    g.write_all(b"after the delete\n").unwrap();
    assert!(read().lines.is_empty());
    drop(g);
    assert_eq!(held(&path), 0, "a deleted journal is not held");
    std::fs::write(&path, b"new\n").unwrap();
    let batch = read();
    assert!(batch.restarted);
    assert_eq!(lines(&batch), [b"new"]);
}
