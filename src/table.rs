//! Plain-text tables for the CLI: left-aligned columns two spaces apart.
//!
//! Invariant: every row has the header's number of cells; widths count characters, not bytes;
//! no line ends in spaces.

/// Renders `header` and `rows` as aligned columns, one line each.
pub fn render<const N: usize>(header: [&str; N], rows: &[[String; N]]) -> String {
    let widths = widths(header, rows.iter().map(|row| row.each_ref()));
    let mut out = line(&widths, header);
    for row in rows {
        out.push_str(&line(&widths, row.each_ref()));
    }
    out
}

/// The width of each column over `header` and `rows`: a first pass, for a table written row
/// by row ([`line()`]) without holding its rows.
pub fn widths<S: AsRef<str>, const N: usize>(
    header: [&str; N],
    rows: impl Iterator<Item = [S; N]>,
) -> [usize; N] {
    let mut widths = header.map(|h| h.chars().count());
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.as_ref().chars().count());
        }
    }
    widths
}

/// One line of a table whose columns are `widths` wide, newline included.
pub fn line<S: AsRef<str>, const N: usize>(widths: &[usize; N], cells: [S; N]) -> String {
    let text: Vec<String> = cells
        .iter()
        .zip(widths)
        .map(|(c, w)| format!("{:<w$}", c.as_ref()))
        .collect();
    let mut out = text.join("  ").trim_end().to_owned();
    out.push('\n');
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
