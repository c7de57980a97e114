//! Least privilege on ZooKeeper: digest ACLs on the prefix node and its audit node.
//!
//! ZooKeeper's ACLs are per node and not inherited: a node's ACL says who may read it, change
//! its data, change its ACL, and create or delete its *children*. So the prefix node's ACL
//! decides who may create lock paths (and `%audit`, `%limits`) under it, and every node the
//! engine creates below carries the ACL the engine gives it: with digest credentials in the
//! URL, `auth` (the creating identity: all rights) and `world:anyone` (read), as Curator's
//! recipes with credentials; without, `world:anyone` with all rights.

use super::paths::zk_prefix;
use crate::core::access::{
    validate_user, AccessPlan, AccessStep, AccessUser, PASSWORD_PLACEHOLDER,
};
use crate::core::error::{Error, Result};

/// A zkCli.sh argument: its parser splits on blanks and takes a quoted argument (`"..."` or
/// `'...'`, without escapes) whole, so an argument holding either is quoted with the quote it
/// does not hold (the plan refuses a prefix holding both; user names and digests hold none).
fn zkcli_quote(arg: &str) -> String {
    if !arg.is_empty() && !arg.contains([' ', '\t', '"', '\'']) {
        arg.to_owned()
    } else if !arg.contains('"') {
        format!("\"{arg}\"")
    } else {
        format!("'{arg}'")
    }
}

/// The zkCli.sh lines that create the prefix node (and its parents) and give it, and its
/// audit node, an ACL that lets `user` do everything and `read_only` read.
pub(crate) fn plan(prefix: &str, user: &str, read_only: &str) -> Result<AccessPlan> {
    validate_user(user)?;
    validate_user(read_only)?;
    let root = zk_prefix(prefix)?;
    if root.contains('"') && root.contains('\'') {
        return Err(Error::invalid(format!(
            "the prefix {prefix:?} holds both kinds of quote, which no zkCli.sh line can \
             write; choose another prefix"
        )));
    }
    let node = root.trim_end_matches('/').to_owned();
    let audit = format!("{root}%audit");
    let step = |args: &[&str]| {
        AccessStep::command(args.iter().map(|a| (*a).to_owned()).collect(), zkcli_quote)
    };
    // Every ancestor of the prefix, for zkCli.sh's create, which does not make parents.
    let ancestors: Vec<String> = node
        .match_indices('/')
        .skip(1)
        .map(|(i, _)| node[..i].to_owned())
        .collect();
    let acl =
        format!("digest:{user}:<{user}-digest>:cdrwa,digest:{read_only}:<{read_only}-digest>:r");
    let mut steps = Vec::new();
    for path in [&node, &audit] {
        steps.push(step(&["create", path]));
        steps.push(step(&["setAcl", path, &acl]));
    }
    Ok(AccessPlan {
        engine: "zookeeper",
        runs_in: "zkCli.sh",
        setup: ancestors.iter().map(|a| step(&["create", a])).collect(),
        users: vec![
            AccessUser {
                name: user.to_owned(),
                read_only: false,
                steps,
            },
            AccessUser {
                name: read_only.to_owned(),
                read_only: true,
                steps: Vec::new(),
            },
        ],
        notes: vec![
            format!(
                "replace <NAME-digest> by base64(SHA-1(\"NAME:{PASSWORD_PLACEHOLDER}\")): \
                 printf %s 'NAME:{PASSWORD_PLACEHOLDER}' | openssl dgst -sha1 -binary | base64, \
                 or java -cp \"$ZOOKEEPER_HOME/lib/*\" \
                 org.apache.zookeeper.server.auth.DigestAuthenticationProvider \
                 NAME:{PASSWORD_PLACEHOLDER}"
            ),
            "run the lines in zkCli.sh as an identity that may create the prefix's parents and \
             change the ACL of the prefix if it exists (addauth digest ADMIN:PASSWORD first \
             when they are not open); \"Node already exists\" from a create is harmless"
                .into(),
            format!(
                "give the services their identity in the URL (zk://{user}:{PASSWORD_PLACEHOLDER}@host:2181, \
                 or password_file=): without one, the engine creates every lock path and audit \
                 node open to all (world:anyone:cdrwa) and the prefix's ACL then refuses it"
            ),
            format!(
                "ACLs are per node, not inherited: the prefix's ACL confines who creates lock \
                 paths under it; each lock path and waiter node carries the ACL of the \
                 identity that created it (that identity: cdrwa; world:anyone: r), so only {user} \
                 can queue on, or force-release, a lock it created; {read_only} needs no step \
                 of its own beyond its r on the two nodes above"
            ),
            "reading is not confined: every node below the prefix is readable by any identity \
             (holders' host, pid and client name included), as Curator's recipes leave them"
                .into(),
            "audit records cannot be confined: the per-name directories under %audit are open \
             (so that every identity sharing the prefix can record its forced releases), and \
             ZooKeeper lets whoever may delete a directory's children erase a record"
                .into(),
            format!(
                "lock paths created before the ACL was set keep theirs (open to all when \
                 created without credentials): they are containers, gone once empty; check with \
                 getAcl {node}/NAME"
            ),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_acl_is_set_on_the_prefix_and_its_audit_node() {
        let p = plan(crate::DEFAULT_PREFIX, "svc", "svc-ro").unwrap();
        let lines: Vec<&str> = p.setup.iter().map(|s| s.line.as_str()).collect();
        assert_eq!(lines, ["create /fencelock"]);
        let lines: Vec<&str> = p.users[0].steps.iter().map(|s| s.line.as_str()).collect();
        let acl = "digest:svc:<svc-digest>:cdrwa,digest:svc-ro:<svc-ro-digest>:r";
        assert_eq!(
            lines,
            [
                "create /fencelock/v1".to_owned(),
                format!("setAcl /fencelock/v1 {acl}"),
                "create /fencelock/v1/%audit".to_owned(),
                format!("setAcl /fencelock/v1/%audit {acl}"),
            ]
        );
        assert!(p.users[1].read_only && p.users[1].steps.is_empty());
        let odd = plan("/a b/c", "svc", "svc-ro").unwrap();
        assert_eq!(odd.setup[0].line, "create \"/a b\"");
        assert!(plan("/a'b\"", "svc", "svc-ro").is_err());
        assert!(plan("/svc/", "svc;rm", "svc-ro").is_err());
        assert!(plan("/zookeeper/x", "svc", "svc-ro").is_err());
    }
}
