//! Reading files of lines that may be damaged (a snapshot, the request log): one line at a
//! time, none held beyond a cap, so a file without line ends cannot take the memory.

use std::io::{BufRead, Read};

/// Reads the next line of `r` into `buf`, without its end: `Some(true)`; `Some(false)` when
/// it is longer than `cap` bytes (read past, not held); `None` at the end of the file.
pub fn next_line(
    r: &mut impl BufRead,
    buf: &mut Vec<u8>,
    cap: u64,
) -> std::io::Result<Option<bool>> {
    buf.clear();
    let n = (&mut *r)
        .take(cap.saturating_add(1))
        .read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        return Ok(Some(true));
    }
    if n as u64 > cap {
        buf.clear();
        r.skip_until(b'\n')?;
        return Ok(Some(false));
    }
    // The last line, without an end.
    Ok(Some(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_past_the_cap_are_skipped_and_the_rest_read() {
        let text = format!("short\n{}\nafter\n{}", "x".repeat(100), "y".repeat(100));
        let mut r = std::io::BufReader::with_capacity(16, text.as_bytes());
        let mut buf = Vec::new();
        let mut seen = Vec::new();
        while let Some(whole) = next_line(&mut r, &mut buf, 10).unwrap() {
            seen.push(whole.then(|| String::from_utf8(buf.clone()).unwrap()));
        }
        assert_eq!(
            seen,
            [Some("short".into()), None, Some("after".into()), None]
        );
    }
}
