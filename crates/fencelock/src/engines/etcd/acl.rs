//! Least privilege on etcd: RBAC roles on the prefix's key range.
//!
//! Every key fencelock writes on etcd lies under the client's prefix: the waiters of every
//! lock and election (`<prefix><name>/<lease>`) and the audit records (`<prefix>%audit/`). So
//! one role with `readwrite` on that range serves every operation; leases need no permission
//! of their own (etcd lets any user grant a lease, and checks a revocation against the keys
//! attached to it).

use super::etcd_prefix;
use crate::core::access::{shell_quote, validate_user, AccessPlan, AccessStep, AccessUser};
use crate::core::error::Result;

/// The `etcdctl` commands that create a read-write `user` and a `read_only` one on the key
/// range of `prefix`, each with a role of its own name.
pub(crate) fn plan(prefix: &str, user: &str, read_only: &str) -> Result<AccessPlan> {
    validate_user(user)?;
    validate_user(read_only)?;
    let range = etcd_prefix(prefix);
    let step = |args: &[&str]| {
        let argv: Vec<String> = std::iter::once("etcdctl")
            .chain(args.iter().copied())
            .map(str::to_owned)
            .collect();
        AccessStep::command(argv, shell_quote)
    };
    let user_of = |name: &str, permission: &str| AccessUser {
        name: name.to_owned(),
        read_only: permission == "read",
        steps: vec![
            step(&["role", "add", name]),
            step(&[
                "role",
                "grant-permission",
                name,
                "--prefix=true",
                permission,
                &range,
            ]),
            // Asks for the password (twice) on the terminal; nothing is printed or stored.
            step(&["user", "add", name]),
            step(&["user", "grant-role", name, name]),
        ],
    };
    Ok(AccessPlan {
        engine: "etcd",
        runs_in: "shell",
        setup: Vec::new(),
        users: vec![user_of(user, "readwrite"), user_of(read_only, "read")],
        notes: vec![
            "etcdctl user add asks for the new user's password on the terminal \
             (--interactive=false reads it from standard input instead)"
                .into(),
            "on a cluster with auth enabled, run the lines as root (--user root, or \
             ETCDCTL_USER); on one without, create the root user and run etcdctl auth enable \
             after them"
                .into(),
            format!(
                "the range also covers every prefix that starts with {range:?}: give services \
                 prefixes of which none starts another"
            ),
            "within the prefix, a client with the role can write every key: the lowest-revision \
             rule and the fencing token (the key's revision) protect one holder from another"
                .into(),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_roles_cover_the_prefix_range_only() {
        let p = plan("/svc/", "svc", "svc-ro").unwrap();
        assert_eq!(
            p.users[0].steps[1].line,
            "etcdctl role grant-permission svc --prefix=true readwrite /svc/"
        );
        assert_eq!(
            p.users[1].steps[1].line,
            "etcdctl role grant-permission svc-ro --prefix=true read /svc/"
        );
        // The default prefix is the etcd engine's own, as a path.
        let d = plan(crate::DEFAULT_PREFIX, "svc", "svc-ro").unwrap();
        assert!(d.users[0].steps[1].line.ends_with(" /fencelock/v1/"));
        assert!(plan("/svc/", "svc;rm", "svc-ro").is_err());
    }
}
