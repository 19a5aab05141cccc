//! `strftime_now(format)`: the date global transformers gives chat templates.
//!
//! Llama 3 style templates print today's date into the system turn with it. transformers calls
//! `datetime.now().strftime(format)`; this formats the current UTC time with the C-locale
//! directives those templates use, without pulling a date crate into the core.

use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] =
    ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// A broken-down UTC time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CivilTime {
    pub year: i64,
    /// 1..=12
    pub month: u32,
    /// 1..=31
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    /// 0 = Monday .. 6 = Sunday
    pub weekday: u32,
    /// 1..=366
    pub day_of_year: u32,
}

impl CivilTime {
    /// The UTC time `secs` seconds after the Unix epoch.
    pub fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        let jan1 = days_from_civil(year, 1, 1);
        CivilTime {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
            // 1970-01-01 was a Thursday (index 3).
            weekday: (days + 3).rem_euclid(7) as u32,
            day_of_year: (days - jan1 + 1) as u32,
        }
    }

    /// Now, in UTC.
    pub fn now() -> Self {
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        Self::from_unix(secs)
    }

    /// Format with strftime directives; unknown directives are copied through as glibc does.
    pub fn format(&self, fmt: &str) -> String {
        let mut out = String::new();
        let mut chars = fmt.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let Some(d) = chars.next() else {
                out.push('%');
                break;
            };
            let hour12 = if self.hour.is_multiple_of(12) { 12 } else { self.hour % 12 };
            let month = MONTHS[(self.month - 1) as usize];
            let weekday = WEEKDAYS[self.weekday as usize];
            match d {
                'Y' => out.push_str(&self.year.to_string()),
                'y' => out.push_str(&format!("{:02}", self.year.rem_euclid(100))),
                'm' => out.push_str(&format!("{:02}", self.month)),
                'd' => out.push_str(&format!("{:02}", self.day)),
                'e' => out.push_str(&format!("{:>2}", self.day)),
                'H' => out.push_str(&format!("{:02}", self.hour)),
                'I' => out.push_str(&format!("{:02}", hour12)),
                'M' => out.push_str(&format!("{:02}", self.minute)),
                'S' => out.push_str(&format!("{:02}", self.second)),
                'p' => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                'B' => out.push_str(month),
                'b' | 'h' => out.push_str(&month[..3]),
                'A' => out.push_str(weekday),
                'a' => out.push_str(&weekday[..3]),
                'j' => out.push_str(&format!("{:03}", self.day_of_year)),
                'u' => out.push_str(&(self.weekday + 1).to_string()),
                'w' => out.push_str(&((self.weekday + 1) % 7).to_string()),
                'F' => out.push_str(&format!("{}-{:02}-{:02}", self.year, self.month, self.day)),
                'T' => out.push_str(&format!("{:02}:{:02}:{:02}", self.hour, self.minute, self.second)),
                'D' => out.push_str(&format!("{:02}/{:02}/{:02}", self.month, self.day, self.year.rem_euclid(100))),
                'Z' | 'z' => {}
                '%' => out.push('%'),
                other => {
                    out.push('%');
                    out.push(other);
                }
            }
        }
        out
    }
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// (year, month, day) to days since 1970-01-01.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = month as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_seconds_convert_to_the_right_calendar_day() {
        // 2024-02-29T13:05:09Z, a Thursday, day 60 of a leap year.
        let t = CivilTime::from_unix(1_709_211_909);
        assert_eq!((t.year, t.month, t.day, t.hour, t.minute, t.second), (2024, 2, 29, 13, 5, 9));
        assert_eq!(t.weekday, 3);
        assert_eq!(t.day_of_year, 60);
        assert_eq!(CivilTime::from_unix(0).format("%Y-%m-%d %A"), "1970-01-01 Thursday");
    }

    #[test]
    fn format_handles_the_directives_templates_use() {
        let t = CivilTime::from_unix(1_709_211_909);
        assert_eq!(t.format("%d %b %Y"), "29 Feb 2024");
        assert_eq!(t.format("%B %d, %Y %I:%M %p"), "February 29, 2024 01:05 PM");
        assert_eq!(t.format("%a %j %y %% %F %T %Q"), "Thu 060 24 % 2024-02-29 13:05:09 %Q");
    }
}
