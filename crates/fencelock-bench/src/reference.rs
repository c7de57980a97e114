//! `redis-benchmark` as the yardstick for Redis engines: the cheapest single round trips of
//! each kind (a SET, an EVALSHA of a no-op script) run by the same server in the same run, so
//! that fencelock's figures read as a share of what the machine and the server allow rather
//! than as absolute numbers that change from one VM to the next. Also how several reference
//! runs are summed up, around or between fencelock's.

use std::time::Duration;

use crate::servers::Servers;

/// The key `redis-benchmark -t set` writes.
pub(crate) const REFERENCE_SET_KEY: &str = "key:__rand_int__";

/// `redis-benchmark` against the first node: SET, and EVALSHA of a trivial script, each the
/// cheapest single round trip of its kind, as a ceiling for one acquire plus one release.
#[derive(Clone)]
pub(crate) struct Reference {
    bin: String,
    pub(crate) version: String,
    pub(crate) node: String,
    args: Vec<String>,
    sha: String,
    pub(crate) created_set_key: bool,
}

#[derive(Clone)]
pub(crate) struct PairRate {
    pub(crate) set: f64,
    pub(crate) evalsha: f64,
}

impl PairRate {
    pub(crate) fn pair(&self) -> f64 {
        1.0 / (1.0 / self.set + 1.0 / self.evalsha)
    }
}

impl Reference {
    pub(crate) async fn prepare(servers: &Servers) -> std::result::Result<Reference, String> {
        let bin = std::env::var("FENCELOCK_REDIS_BENCHMARK")
            .ok()
            .filter(|b| !b.is_empty())
            .unwrap_or_else(|| "redis-benchmark".to_owned());
        let version = tokio::process::Command::new(&bin)
            .arg("--version")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|e| {
                format!("{bin}: {e}; install redis-tools or set FENCELOCK_REDIS_BENCHMARK")
            })?;
        let version = String::from_utf8_lossy(&version.stdout)
            .split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ");
        let t = &servers.target;
        let node = t.nodes.first().ok_or("no nodes")?;
        let mut args = vec![
            "-h".to_owned(),
            node.host.clone(),
            "-p".to_owned(),
            node.port.to_string(),
        ];
        if let Some(u) = &t.user {
            args.extend(["--user".to_owned(), u.clone()]);
        }
        if t.password.is_some() {
            // redis-benchmark takes a password only on its command line (`-a`, `-u`), where
            // `ps` shows it to every user of the machine, and reads no environment variable.
            return Err(
                "skipped: the server needs a password and redis-benchmark would show it in \
                 its argv"
                    .to_owned(),
            );
        }
        if t.db != 0 {
            args.extend(["--dbnum".to_owned(), t.db.to_string()]);
        }
        let sha = servers.text(0, &["SCRIPT", "LOAD", "return 1"]).await?;
        let existed = servers.int(0, &["EXISTS", REFERENCE_SET_KEY]).await?;
        Ok(Reference {
            bin,
            version,
            node: servers.addrs[0].clone(),
            args,
            sha,
            created_set_key: existed == 0,
        })
    }

    pub(crate) async fn measure(&self, clients: u32) -> std::result::Result<PairRate, String> {
        self.measure_n(clients, if clients == 1 { 20_000 } else { 100_000 })
            .await
    }

    pub(crate) async fn measure_n(
        &self,
        clients: u32,
        requests: u32,
    ) -> std::result::Result<PairRate, String> {
        let set = self.rps(clients, requests, &["-t", "set"]).await?;
        let evalsha = self
            .rps(clients, requests, &["EVALSHA", &self.sha, "0"])
            .await?;
        Ok(PairRate { set, evalsha })
    }

    async fn rps(
        &self,
        clients: u32,
        requests: u32,
        test: &[&str],
    ) -> std::result::Result<f64, String> {
        let run = tokio::process::Command::new(&self.bin)
            .args(&self.args)
            .args([
                "-c",
                &clients.to_string(),
                "-n",
                &requests.to_string(),
                "-q",
                "--csv",
            ])
            .args(test)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        let output = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .map_err(|_| format!("{} {} did not finish within 60s", self.bin, test.join(" ")))?
            .map_err(|e| format!("{}: {e}", self.bin))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        // --csv prints a header line, then `"TEST","rps",...` per test.
        stdout
            .lines()
            .filter_map(|l| {
                let mut fields = l.split(',').map(|f| f.trim().trim_matches('"'));
                let test = fields.next()?;
                let rps: f64 = fields.next()?.parse().ok()?;
                (test != "test" && rps > 0.0).then_some(rps)
            })
            .next()
            .ok_or_else(|| {
                let err = String::from_utf8_lossy(&output.stderr);
                format!(
                    "no rate in redis-benchmark's output: {}",
                    first_line(&stdout)
                        .or(first_line(&err))
                        .unwrap_or("(empty)")
                )
            })
    }
}

fn first_line(s: &str) -> Option<&str> {
    s.lines().map(str::trim).find(|l| !l.is_empty())
}

/// A reference measured before and after a fencelock run.
pub(crate) struct Bracket {
    pub(crate) set: f64,
    pub(crate) evalsha: f64,
    pub(crate) pair: f64,
    /// Each run's pair rate, in order.
    pub(crate) runs: Vec<f64>,
}

impl Bracket {
    pub(crate) fn of(
        results: impl IntoIterator<Item = Option<std::result::Result<PairRate, String>>>,
    ) -> std::result::Result<Bracket, String> {
        let (mut runs, mut errors) = (Vec::new(), Vec::new());
        for r in results.into_iter().flatten() {
            match r {
                Ok(r) => runs.push(r),
                Err(e) => errors.push(e),
            }
        }
        if runs.is_empty() {
            return Err(errors
                .into_iter()
                .next()
                .unwrap_or_else(|| "not run".to_owned()));
        }
        let n = runs.len() as f64;
        let pairs: Vec<f64> = runs.iter().map(PairRate::pair).collect();
        Ok(Bracket {
            set: runs.iter().map(|r| r.set).sum::<f64>() / n,
            evalsha: runs.iter().map(|r| r.evalsha).sum::<f64>() / n,
            pair: pairs.iter().sum::<f64>() / n,
            runs: pairs,
        })
    }
}

/// The median of some ratios (the mean of the middle two for an even count).
pub(crate) fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_rate_is_one_set_and_one_evalsha() {
        let p = PairRate {
            set: 60_000.0,
            evalsha: 40_000.0,
        };
        assert!((p.pair() - 24_000.0).abs() < 1e-6);
    }
}
