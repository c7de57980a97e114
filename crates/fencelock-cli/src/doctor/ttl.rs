//! TTL advice from the observed hold-time p99: a TTL of three times the p99 leaves room for
//! pauses and renewals. The p99 comes from the command line or a running fencelock's
//! Prometheus endpoint.

use std::time::Duration;

use super::{DoctorArgs, Findings};

pub(super) async fn ttl_advice(args: &DoctorArgs, f: &mut Findings) {
    let p99 = match (&args.hold_p99, &args.metrics_url) {
        (Some(p), _) => Some(*p),
        (None, Some(url)) => match scrape_hold_p99(url).await {
            Ok(p) => p,
            Err(e) => {
                f.warn(&format!("cannot read the hold-time p99 from {url}: {e}"));
                None
            }
        },
        (None, None) => None,
    };
    outln!("TTL");
    let Some(p99) = p99 else {
        outln!("  note  give --hold-p99 or --metrics-url for TTL advice (TTL = 3 x hold p99)");
        return;
    };
    let advice = p99 * 3;
    let text = format!(
        "hold p99 {}: a TTL of at least {} (3 x p99)",
        crate::human_duration(p99),
        crate::human_duration(advice)
    );
    match args.ttl {
        Some(ttl) if ttl < advice => f.warn(&format!(
            "{text}; the TTL in use, {}, is shorter",
            crate::human_duration(ttl)
        )),
        _ => f.ok(&text),
    }
}

/// Reads the largest hold-time p99 over all resources from a Prometheus text endpoint: either
/// a summary's `quantile="0.99"` sample or, for a histogram, the first bucket holding 99 % of
/// the observations.
async fn scrape_hold_p99(url: &str) -> std::result::Result<Option<Duration>, String> {
    let text = http_get(url).await?;
    Ok(hold_p99_from(&text))
}

fn hold_p99_from(text: &str) -> Option<Duration> {
    const NAME: &str = "fencelock_hold_duration_seconds";
    let value = |l: &str| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok());
    let summary = text
        .lines()
        .filter(|l| l.starts_with(NAME) && l.contains("quantile=\"0.99\""))
        .filter_map(value)
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
    if let Some(s) = summary {
        return Some(Duration::from_secs_f64(s.max(0.0)));
    }
    // Histogram: cumulative buckets of all series together, per upper bound.
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for l in text
        .lines()
        .filter(|l| l.starts_with(&format!("{NAME}_bucket")))
    {
        let le = l
            .split("le=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .and_then(|b| {
                if b == "+Inf" {
                    Some(f64::INFINITY)
                } else {
                    b.parse().ok()
                }
            });
        if let (Some(le), Some(v)) = (le, value(l)) {
            match buckets.iter_mut().find(|(b, _)| *b == le) {
                Some((_, c)) => *c += v,
                None => buckets.push((le, v)),
            }
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets
        .iter()
        .find(|(_, c)| *c >= 0.99 * total)
        .filter(|(b, _)| b.is_finite())
        .map(|(b, _)| Duration::from_secs_f64(*b))
}

/// A plain HTTP/1.0 GET over loopback-or-LAN TCP: enough for a metrics endpoint, without an
/// HTTP client dependency.
async fn http_get(url: &str) -> std::result::Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url
        .strip_prefix("http://")
        .ok_or("only http:// URLs are supported")?;
    let (authority, path) = match rest.split_once('/') {
        Some((a, p)) => (a, format!("/{p}")),
        None => (rest, "/metrics".to_owned()),
    };
    let fetch = async {
        let mut s = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| e.to_string())?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\n\r\n").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut body = String::new();
        s.read_to_string(&mut body)
            .await
            .map_err(|e| e.to_string())?;
        let (head, body) = body.split_once("\r\n\r\n").ok_or("malformed HTTP reply")?;
        if !head.starts_with("HTTP/1.") || head.split_whitespace().nth(1).is_none_or(|c| c != "200")
        {
            return Err(format!(
                "HTTP status {}",
                head.lines().next().unwrap_or_default()
            ));
        }
        Ok(body.to_owned())
    };
    tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .map_err(|_| "no answer within 5s".to_owned())?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hold_p99_from_a_summary_or_a_histogram() {
        let summary = "fencelock_hold_duration_seconds{resource=\"a\",quantile=\"0.5\"} 0.2\n\
                       fencelock_hold_duration_seconds{resource=\"a\",quantile=\"0.99\"} 1.5\n\
                       fencelock_hold_duration_seconds{resource=\"b\",quantile=\"0.99\"} 2.5\n";
        assert_eq!(hold_p99_from(summary), Some(Duration::from_millis(2500)));
        let histogram = "fencelock_hold_duration_seconds_bucket{le=\"0.5\"} 50\n\
                         fencelock_hold_duration_seconds_bucket{le=\"1\"} 98\n\
                         fencelock_hold_duration_seconds_bucket{le=\"2\"} 100\n\
                         fencelock_hold_duration_seconds_bucket{le=\"+Inf\"} 100\n";
        assert_eq!(hold_p99_from(histogram), Some(Duration::from_secs(2)));
        assert_eq!(hold_p99_from("other_metric 1\n"), None);
    }
}
