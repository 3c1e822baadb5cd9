//! The snapshot reader on arbitrary markers and lines. The input is a marker (first line) and
//! the snapshot's lines (the rest). An arbitrary marker never panics the reader and is taken
//! only with a MAC that verifies; a genuine marker over the lines is taken, and no change to
//! the lines (one dropped, added, altered or two swapped) or to the marker passes.

use leasegate::contract::{Key, Keyring};
use leasegate::registry::store::snapshot::{LinesDigest, Marker, SnapshotError};

fn digest(lines: &[&[u8]]) -> LinesDigest {
    let mut digest = LinesDigest::default();
    for line in lines {
        digest.push(line);
    }
    digest
}

pub fn check(data: &[u8]) {
    let key = Key::from_bytes([7; 32]);
    let mut keyring = Keyring::new(false);
    keyring.insert(key.clone());
    let mut parts = data.split(|&b| b == b'\n');
    let marker = parts.next().unwrap_or_default();
    let lines: Vec<&[u8]> = parts.collect();

    if let Ok(taken) = Marker::verified(marker, &keyring) {
        assert!(key.verify(taken.mac_input().as_bytes(), &taken.mac));
    }

    let covers = data.len() as u64;
    let genuine = Marker::signed(
        "J",
        -(covers as i128),
        covers,
        (1, 1 + lines.len() as u64),
        digest(&lines),
        &key,
    );
    let bytes = serde_json::to_vec(&genuine).expect("a marker serialises");
    let taken = Marker::verified(&bytes, &keyring).expect("a genuine marker is taken");
    assert_eq!(taken, genuine);
    assert_eq!(taken.check_lines(digest(&lines)), Ok(()));

    let mut more = lines.clone();
    more.push(b"");
    assert!(taken.check_lines(digest(&more)).is_err(), "a line added");
    if let Some((_, fewer)) = lines.split_last() {
        assert!(taken.check_lines(digest(fewer)).is_err(), "a line dropped");
        let mut altered: Vec<Vec<u8>> = lines.iter().map(|l| l.to_vec()).collect();
        match altered[0].first_mut() {
            Some(b) => *b ^= 1,
            None => altered[0].push(b'x'),
        }
        let altered: Vec<&[u8]> = altered.iter().map(Vec::as_slice).collect();
        assert_eq!(
            taken.check_lines(digest(&altered)),
            Err(SnapshotError::Digest),
            "a line altered"
        );
    }
    if lines.len() >= 2 && lines[0] != lines[1] {
        let mut swapped = lines.clone();
        swapped.swap(0, 1);
        assert_eq!(
            taken.check_lines(digest(&swapped)),
            Err(SnapshotError::Digest),
            "two lines swapped"
        );
    }
    let mut value = serde_json::to_value(&genuine).expect("a marker is JSON");
    value["covers"] = (covers + 1).into();
    let changed = serde_json::to_vec(&value).expect("JSON serialises");
    assert!(
        matches!(
            Marker::verified(&changed, &keyring),
            Err(SnapshotError::BadMac(_))
        ),
        "covers changed"
    );
}
