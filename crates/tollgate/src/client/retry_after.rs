//! `Retry-After` parsing (RFC 9110 section 10.2.3).
//!
//! The value is either delay-seconds (ASCII digits) or an HTTP-date in any
//! of its three forms: IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), the
//! obsolete RFC 850 form (`Sunday, 06-Nov-94 08:49:37 GMT`, two-digit year
//! read with the 50-year rule relative to the time of receipt) and asctime
//! (`Sun Nov  6 08:49:37 1994`). A leap second (`:60`) is read as the
//! following second.
//!
//! The `httpdate` crate was considered and not used: it maps two-digit years
//! to a fixed 1970–2069 window, which is not the 50-year rule relative to
//! the time of receipt (received in 2026, `70` must be 2070; received in
//! 2080, `70` must be 2070 and `31` 2131 would be refused as too far ahead
//! under a fixed window), and it does not accept a leap second.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A `Retry-After` value that is neither delay-seconds nor an HTTP-date.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid Retry-After value {value:?}: {reason}")]
pub struct InvalidRetryAfter {
    value: String,
    reason: &'static str,
}

fn invalid(value: &[u8], reason: &'static str) -> InvalidRetryAfter {
    InvalidRetryAfter {
        value: String::from_utf8_lossy(&value[..value.len().min(64)]).into_owned(),
        reason,
    }
}

/// The wait a `Retry-After` value asks for, counted from `received` (the
/// wall-clock time the response was received).
///
/// Delay-seconds too large to represent saturate to [`Duration::MAX`],
/// "longer than any deadline". A date in the past is no wait.
///
/// ```
/// use std::time::{Duration, SystemTime, UNIX_EPOCH};
/// use tollgate::client::retry_after;
/// let received = UNIX_EPOCH + Duration::from_secs(784_111_770); // 1994-11-06 08:49:30 UTC
/// assert_eq!(retry_after(b" 120 ", received), Ok(Duration::from_secs(120)));
/// assert_eq!(retry_after(b"Sun, 06 Nov 1994 08:49:37 GMT", received), Ok(Duration::from_secs(7)));
/// assert!(retry_after(b"1.5", received).is_err());
/// ```
pub fn retry_after(value: &[u8], received: SystemTime) -> Result<Duration, InvalidRetryAfter> {
    let trimmed = trim(value);
    if trimmed.is_empty() {
        return Err(invalid(value, "empty"));
    }
    if trimmed.iter().all(u8::is_ascii_digit) {
        let secs = trimmed.iter().try_fold(0u64, |acc, d| {
            acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        });
        return Ok(secs.map_or(Duration::MAX, Duration::from_secs));
    }
    let text = std::str::from_utf8(trimmed).map_err(|_| invalid(value, "not ASCII"))?;
    if !text.is_ascii() {
        return Err(invalid(value, "not ASCII"));
    }
    let received_secs = unix_seconds(received);
    let stamp = http_date(text, received_secs).ok_or_else(|| {
        invalid(
            value,
            "neither delay-seconds nor an IMF-fixdate, RFC 850 or asctime HTTP-date",
        )
    })?;
    // Count from the exact receipt time, including its fraction of a second.
    let received_ns = received
        .duration_since(UNIX_EPOCH)
        .map_or(0i128, |d| d.as_nanos() as i128);
    let wait_ns = i128::from(stamp) * 1_000_000_000 - received_ns;
    Ok(if wait_ns <= 0 {
        Duration::ZERO
    } else {
        Duration::from_nanos(u64::try_from(wait_ns).unwrap_or(u64::MAX))
    })
}

fn trim(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|b| !matches!(b, b' ' | b'\t'))
        .map_or(start, |i| i + 1);
    &v[start..end]
}

fn unix_seconds(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    }
}

const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];
const DAYS: [&str; 7] = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];
const LONG_DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A calendar instant before validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Civil {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
}

/// Unix seconds of an HTTP-date, or `None` if it is not one.
fn http_date(text: &str, received: i64) -> Option<i64> {
    let civil = imf_fixdate(text)
        .or_else(|| rfc850(text, received))
        .or_else(|| asctime(text))?;
    to_unix(civil)
}

fn digits<const N: usize>(s: &str) -> Option<u32> {
    (s.len() == N && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse().ok())?
}

fn month(s: &str) -> Option<u32> {
    MONTHS.iter().position(|m| *m == s).map(|i| i as u32 + 1)
}

fn time_of_day(s: &str) -> Option<(u32, u32, u32)> {
    let mut it = s.split(':');
    let (h, m, sec) = (it.next()?, it.next()?, it.next()?);
    if it.next().is_some() {
        return None;
    }
    Some((digits::<2>(h)?, digits::<2>(m)?, digits::<2>(sec)?))
}

/// `Sun, 06 Nov 1994 08:49:37 GMT`
fn imf_fixdate(s: &str) -> Option<Civil> {
    let (day_name, rest) = s.split_once(", ")?;
    if !DAYS.contains(&day_name) {
        return None;
    }
    let parts: Vec<&str> = rest.split(' ').collect();
    let [day, mon, year, time, "GMT"] = parts.as_slice() else {
        return None;
    };
    let (hour, minute, second) = time_of_day(time)?;
    Some(Civil {
        year: i64::from(digits::<4>(year)?),
        month: month(mon)?,
        day: digits::<2>(day)?,
        hour,
        minute,
        second,
    })
}

/// `Sunday, 06-Nov-94 08:49:37 GMT`, two-digit year by the 50-year rule.
fn rfc850(s: &str, received: i64) -> Option<Civil> {
    let (day_name, rest) = s.split_once(", ")?;
    if !LONG_DAYS.contains(&day_name) {
        return None;
    }
    let parts: Vec<&str> = rest.split(' ').collect();
    let [date, time, "GMT"] = parts.as_slice() else {
        return None;
    };
    let mut d = date.split('-');
    let (day, mon, yy) = (d.next()?, d.next()?, d.next()?);
    if d.next().is_some() {
        return None;
    }
    let (hour, minute, second) = time_of_day(time)?;
    let now = from_unix(received);
    let mut civil = Civil {
        year: now.year.div_euclid(100) * 100 + i64::from(digits::<2>(yy)?),
        month: month(mon)?,
        day: digits::<2>(day)?,
        hour,
        minute,
        second,
    };
    // RFC 9110: a two-digit year more than 50 years in the future means the
    // most recent past year with those digits.
    let limit = Civil {
        year: now.year + 50,
        ..now
    };
    if civil > limit {
        civil.year -= 100;
    }
    Some(civil)
}

/// `Sun Nov  6 08:49:37 1994` (the day may be space-padded or not).
fn asctime(s: &str) -> Option<Civil> {
    let parts: Vec<&str> = s.split(' ').filter(|p| !p.is_empty()).collect();
    let [day_name, mon, day, time, year] = parts.as_slice() else {
        return None;
    };
    if !DAYS.contains(day_name)
        || !(1..=2).contains(&day.len())
        || !day.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    // Single spaces only, except the padding before a one-digit day.
    let single = format!("{day_name} {mon} {day} {time} {year}");
    let padded = format!("{day_name} {mon}  {day} {time} {year}");
    if s != single && !(day.len() == 1 && s == padded) {
        return None;
    }
    let (hour, minute, second) = time_of_day(time)?;
    Some(Civil {
        year: i64::from(digits::<4>(year)?),
        month: month(mon)?,
        day: day.parse().ok()?,
        hour,
        minute,
        second,
    })
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to the civil date (proleptic Gregorian).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (i64::from(m) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn to_unix(c: Civil) -> Option<i64> {
    if !(1..=12).contains(&c.month)
        || c.day == 0
        || c.day > days_in_month(c.year, c.month)
        || c.hour > 23
        || c.minute > 59
        || c.second > 60
    {
        return None;
    }
    let days = days_from_civil(c.year, c.month, c.day);
    // A leap second (:60) is the first second of the next minute.
    Some(days * 86_400 + i64::from(c.hour) * 3600 + i64::from(c.minute) * 60 + i64::from(c.second))
}

fn from_unix(secs: i64) -> Civil {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Inverse of days_from_civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    Civil {
        year,
        month,
        day,
        hour: (rem / 3600) as u32,
        minute: (rem % 3600 / 60) as u32,
        second: (rem % 60) as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn civil_round_trips() {
        for secs in [
            0i64,
            784_111_777,
            951_782_400,
            4_102_444_800,
            -86_400,
            1_483_228_800,
        ] {
            let c = from_unix(secs);
            assert_eq!(to_unix(c), Some(secs), "{c:?}");
        }
    }

    #[test]
    fn asctime_spacing() {
        assert!(asctime("Sun Nov  6 08:49:37 1994").is_some());
        assert!(asctime("Sun Nov 6 08:49:37 1994").is_some());
        assert!(asctime("Sun Nov 06 08:49:37 1994").is_some());
        assert!(asctime("Sun  Nov 6 08:49:37 1994").is_none());
        assert!(asctime("Sun Nov 6 08:49:37  1994").is_none());
    }

    proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64), secs in -10_000_000_000i64..10_000_000_000) {
            let received = if secs >= 0 { UNIX_EPOCH + Duration::from_secs(secs as u64) } else { UNIX_EPOCH - Duration::from_secs((-secs) as u64) };
            let _ = retry_after(&bytes, received);
        }

        #[test]
        fn imf_fixdate_matches_civil_arithmetic(secs in 0i64..8_000_000_000) {
            let c = from_unix(secs);
            let text = format!("Mon, {:02} {} {:04} {:02}:{:02}:{:02} GMT", c.day, MONTHS[(c.month - 1) as usize], c.year, c.hour, c.minute, c.second);
            prop_assert_eq!(http_date(&text, 0), Some(secs));
        }
    }
}
