//! `fencelock acl`: prints what an operator runs to create a user that may use fencelock under
//! one prefix and nothing else, and a read-only user for the runbook. The plans come from the
//! library (`Backend::access_plan`); this file only prints them.

use anyhow::Result;
use clap::Args;

use crate::{fail, json, BackendArg};

#[derive(Args, Debug)]
#[command(
    after_help = "Nothing is connected to and no password is printed: the lines hold \
    <password> where the operator puts one (Redis), or ask for it (etcdctl user add, psql \
    \\password). Redis: run the lines on every node. See docs/security.md for what the users \
    protect against and what they do not."
)]
pub struct AclArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// The read-write user (or role) to create.
    #[arg(long, default_value = "fencelock")]
    user: String,
    /// The read-only user for inspect, list and audit. Default: the user's name and `-ro`.
    #[arg(long)]
    read_only_user: Option<String>,
    /// Print one JSON object: each user's steps as argument arrays (`argv`) and lines.
    #[arg(long)]
    json: bool,
}

pub async fn acl(args: AclArgs) -> Result<u8> {
    let url = match &args.backend.backend {
        Some(u) => u.clone(),
        None => fencelock::default_url().map_err(fail)?,
    };
    let backend = fencelock::Backend::parse(&url).map_err(fail)?;
    let read_only = args
        .read_only_user
        .clone()
        .unwrap_or_else(|| format!("{}-ro", args.user));
    let plan = backend
        .access_plan(&args.backend.prefix, &args.user, &read_only)
        .map_err(fail)?;
    if args.json {
        outln!("{}", to_json(&plan, &args.backend.prefix));
    } else {
        out!("{}", to_text(&plan, &args.backend.prefix));
    }
    Ok(0)
}

fn to_text(plan: &fencelock::AccessPlan, prefix: &str) -> String {
    let c = if plan.runs_in == "psql" { "--" } else { "#" };
    let mut out = format!(
        "{c} fencelock acl: {} under the prefix {prefix:?}{}\n",
        plan.engine,
        match plan.runs_in {
            "redis-cli" => ", to run in redis-cli on every node",
            "psql" => ", to run in psql",
            "shell" => ", to run in a shell",
            "zkCli.sh" => ", to run in zkCli.sh",
            _ => "",
        }
    );
    if !plan.setup.is_empty() {
        let who = if plan.runs_in == "psql" {
            "as the owner of fencelock's tables (or the role that will own them)"
        } else {
            "the parents of the prefix"
        };
        out.push_str(&format!("\n{c} first, once, {who}\n"));
        for s in &plan.setup {
            out.push_str(&s.line);
            out.push('\n');
        }
    }
    for u in &plan.users {
        let what = if u.read_only {
            format!("read-only user {} (inspect, list, audit)", u.name)
        } else {
            format!("read-write user {}", u.name)
        };
        out.push_str(&format!("\n{c} {what}\n"));
        for s in &u.steps {
            out.push_str(&s.line);
            out.push('\n');
        }
    }
    out.push('\n');
    for n in &plan.notes {
        out.push_str(&format!("{c} note: {n}\n"));
    }
    out
}

fn to_json(plan: &fencelock::AccessPlan, prefix: &str) -> String {
    let list = |items: Vec<String>| format!("[{}]", items.join(","));
    let step = |s: &fencelock::AccessStep| {
        format!(
            "{{\"argv\":{},\"line\":{}}}",
            list(s.argv.iter().map(|a| json::string(a)).collect()),
            json::string(&s.line)
        )
    };
    let users = plan
        .users
        .iter()
        .map(|u| {
            let steps = u.steps.iter().map(step).collect();
            format!(
                "{{\"name\":{},\"read_only\":{},\"steps\":{}}}",
                json::string(&u.name),
                u.read_only,
                list(steps)
            )
        })
        .collect();
    format!(
        "{{\"engine\":{},\"prefix\":{},\"runs_in\":{},\"setup\":{},\"users\":{},\"notes\":{}}}",
        json::string(plan.engine),
        json::string(prefix),
        json::string(plan.runs_in),
        list(plan.setup.iter().map(step).collect()),
        list(users),
        list(plan.notes.iter().map(|n| json::string(n)).collect())
    )
}
