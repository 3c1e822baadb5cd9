//! Plain-text tables for the CLI: left-aligned columns two spaces apart.
//!
//! Invariant: every row has the header's number of cells; widths count characters, not bytes;
//! no line ends in spaces.

/// Renders `header` and `rows` as aligned columns, one line each.
pub fn render<const N: usize>(header: [&str; N], rows: &[[String; N]]) -> String {
    let mut widths = header.map(str::len);
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cols: [&str; N]| {
        let text: Vec<String> = cols
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(text.join("  ").trim_end());
        out.push('\n');
    };
    line(header);
    for row in rows {
        line(std::array::from_fn(|i| row[i].as_str()));
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn columns_align_on_characters_and_lines_end_clean() {
        let table = super::render(
            ["A", "LONGER"],
            &[
                ["bücher".to_owned(), String::new()],
                ["x".to_owned(), "y".to_owned()],
            ],
        );
        assert_eq!(table, "A       LONGER\nbücher\nx       y\n");
    }
}
