//! Checks of a kernel call's inputs that their slices' lengths do not show: buffers that
//! share memory while one of them is written, and query rows that two attention tasks
//! would both write. The binding runs the first on the buffers Python hands it; the
//! attention kernel runs the second on every call.

/// The bytes `start..end` a buffer of one call covers, its name for the error, and whether
/// the call writes it.
#[derive(Clone, Copy, Debug)]
pub struct Span<'a> {
    pub name: &'a str,
    pub start: usize,
    pub end: usize,
    pub written: bool,
}

/// Fails naming two buffers that overlap where one of them is written (a `&mut` slice must
/// alias nothing); readers may share memory (q, k and v read from one fused q/k/v row).
/// Empty buffers cover nothing.
pub fn check_no_aliasing(spans: &[Span]) -> Result<(), String> {
    let mut sorted: Vec<&Span> = spans.iter().filter(|s| s.start < s.end).collect();
    sorted.sort_unstable_by_key(|s| s.start);
    // The spans seen so far reaching furthest, of all and of the written ones: a span that
    // starts before one of them ends overlaps it.
    let mut reach: Option<&Span> = None;
    let mut reach_written: Option<&Span> = None;
    for &s in &sorted {
        let hit = if s.written { reach } else { reach_written };
        if let Some(o) = hit.filter(|o| s.start < o.end) {
            return Err(format!(
                "{} and {} share memory, and the call writes {}",
                o.name,
                s.name,
                if s.written { s.name } else { o.name }
            ));
        }
        if reach.is_none_or(|r| s.end > r.end) {
            reach = Some(s);
        }
        if s.written && reach_written.is_none_or(|r| s.end > r.end) {
            reach_written = Some(s);
        }
    }
    Ok(())
}

/// Fails if `reqs` names a request twice or two requests whose query rows
/// (`query_start_loc[r]..query_start_loc[r + 1]`) overlap: each request's tasks write its
/// rows of the output without a lock. `reqs` must index `query_start_loc` (checked before).
pub fn check_distinct_rows(reqs: &[i32], query_start_loc: &[i32]) -> Result<(), String> {
    let mut rows: Vec<(i32, i32, i32)> = reqs
        .iter()
        .map(|&r| {
            let r_ = r as usize;
            (query_start_loc[r_], query_start_loc[r_ + 1], r)
        })
        .collect();
    rows.sort_unstable();
    for pair in rows.windows(2) {
        let [(s0, e0, r0), (s1, e1, r1)] = [pair[0], pair[1]];
        if r0 == r1 {
            return Err(format!("reqs holds request {r0} twice"));
        }
        if s1 < e0 {
            return Err(format!(
                "requests {r0} and {r1} own overlapping query rows {s0}..{e0} and {s1}..{e1}"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(name: &str, start: usize, end: usize, written: bool) -> Span<'_> {
        Span {
            name,
            start,
            end,
            written,
        }
    }

    #[test]
    fn readers_may_share_memory() {
        let spans = [
            span("q", 0, 64, false),
            span("k", 32, 96, false),
            span("out", 96, 128, true),
        ];
        assert_eq!(check_no_aliasing(&spans), Ok(()));
    }

    #[test]
    fn a_written_buffer_overlapping_a_read_one_fails_naming_both() {
        let spans = [span("out", 60, 100, true), span("x", 0, 64, false)];
        let err = check_no_aliasing(&spans).unwrap_err();
        assert!(
            err.contains("x and out") && err.contains("writes out"),
            "{err}"
        );
    }

    #[test]
    fn a_read_buffer_inside_an_earlier_long_written_one_fails() {
        // the written span is not the last one before the reader: the sweep keeps the furthest
        let spans = [
            span("cache", 0, 1000, true),
            span("w", 10, 20, false),
            span("x", 500, 510, false),
        ];
        assert!(check_no_aliasing(&spans).is_err());
    }

    #[test]
    fn two_written_buffers_may_not_overlap() {
        let spans = [span("hidden", 0, 16, true), span("out", 8, 24, true)];
        assert!(check_no_aliasing(&spans).is_err());
    }

    #[test]
    fn adjacent_and_empty_buffers_do_not_overlap() {
        let spans = [
            span("a", 0, 16, true),
            span("b", 16, 32, true),
            span("e", 4, 4, true),
        ];
        assert_eq!(check_no_aliasing(&spans), Ok(()));
    }

    #[test]
    fn distinct_requests_with_disjoint_rows_pass_in_any_order() {
        assert_eq!(check_distinct_rows(&[2, 0, 1], &[0, 3, 3, 7]), Ok(()));
    }

    #[test]
    fn a_request_named_twice_fails() {
        let err = check_distinct_rows(&[1, 0, 1], &[0, 3, 4]).unwrap_err();
        assert!(err.contains("request 1 twice"), "{err}");
        // also when it owns no rows
        assert!(check_distinct_rows(&[0, 0], &[0, 0]).is_err());
    }

    #[test]
    fn requests_with_overlapping_rows_fail() {
        let err = check_distinct_rows(&[0, 2], &[0, 4, 2, 5]).unwrap_err();
        assert!(err.contains("overlapping"), "{err}");
    }
}
