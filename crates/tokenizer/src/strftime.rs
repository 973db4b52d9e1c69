// SPDX-License-Identifier: MIT OR Apache-2.0
//! `strftime_now(format)`, which Llama-3.x templates call for "Today Date". A small `strftime`
//! over the civil date, in UTC: the engine has no time zone database, and servers run in UTC.

use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A UTC date and time broken into fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DateTime {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Monday
    weekday: u32,
    /// 1..=366
    day_of_year: u32,
}

impl DateTime {
    /// Now, in UTC.
    pub fn now_utc() -> Self {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        Self::from_unix(secs)
    }

    /// Seconds since 1970-01-01T00:00:00Z.
    pub fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        // Howard Hinnant's civil_from_days.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        const CUMULATIVE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let day_of_year = CUMULATIVE[month as usize - 1] + day + u32::from(leap && month > 2);
        DateTime {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
            weekday: (days + 3).rem_euclid(7) as u32, // 1970-01-01 was a Thursday
            day_of_year,
        }
    }

    /// Formats like C's `strftime` in the C locale (glibc's `%-d` no-padding flag included).
    /// Unknown directives are copied through.
    pub fn format(&self, fmt: &str) -> String {
        let mut out = String::new();
        let mut chars = fmt.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let mut spec = chars.next();
            let unpadded = spec == Some('-');
            if unpadded {
                spec = chars.next();
            }
            let num = |v: i64, width: usize| {
                if unpadded {
                    v.to_string()
                } else {
                    format!("{v:0width$}")
                }
            };
            let hour12 = match self.hour % 12 {
                0 => 12,
                h => h,
            };
            match spec {
                Some('d') => out.push_str(&num(self.day.into(), 2)),
                Some('e') => out.push_str(&if unpadded {
                    self.day.to_string()
                } else {
                    format!("{:2}", self.day)
                }),
                Some('m') => out.push_str(&num(self.month.into(), 2)),
                Some('Y') => out.push_str(&self.year.to_string()),
                Some('y') => out.push_str(&num(self.year.rem_euclid(100), 2)),
                Some('B') => out.push_str(MONTHS[self.month as usize - 1]),
                Some('b' | 'h') => out.push_str(&MONTHS[self.month as usize - 1][..3]),
                Some('A') => out.push_str(WEEKDAYS[self.weekday as usize]),
                Some('a') => out.push_str(&WEEKDAYS[self.weekday as usize][..3]),
                Some('H') => out.push_str(&num(self.hour.into(), 2)),
                Some('I') => out.push_str(&num(hour12.into(), 2)),
                Some('M') => out.push_str(&num(self.minute.into(), 2)),
                Some('S') => out.push_str(&num(self.second.into(), 2)),
                Some('p') => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                Some('j') => out.push_str(&num(self.day_of_year.into(), 3)),
                Some('F') => {
                    out.push_str(&format!("{}-{:02}-{:02}", self.year, self.month, self.day))
                }
                Some('T') => out.push_str(&format!(
                    "{:02}:{:02}:{:02}",
                    self.hour, self.minute, self.second
                )),
                Some('%') => out.push('%'),
                Some(other) => {
                    out.push('%');
                    if unpadded {
                        out.push('-');
                    }
                    out.push(other);
                }
                None => out.push('%'),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_dates() {
        // 2024-07-26T13:05:09Z, a Friday, day 208 of a leap year.
        let t = DateTime::from_unix(1_721_999_109);
        assert_eq!(t.format("%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            t.format("%A %B %-d, %y %H:%M:%S %I%p %j %%"),
            "Friday July 26, 24 13:05:09 01PM 208 %"
        );
        assert_eq!(
            DateTime::from_unix(0).format("%F %T %a"),
            "1970-01-01 00:00:00 Thu"
        );
        assert_eq!(
            DateTime::from_unix(951_782_400).format("%F %j"),
            "2000-02-29 060"
        );
    }
}
