//! Resource names: checked before any I/O so that a bad name never reaches an engine.

use crate::core::error::{Error, Result};

/// The longest resource name accepted, in bytes of UTF-8.
pub const MAX_NAME_BYTES: usize = 256;

/// Checks a resource name: 1 to 256 bytes of UTF-8 without control characters.
///
/// Every byte sequence that passes is a distinct resource: engines derive their keys from the
/// name by prefixing or escaping, never by truncating or folding case.
pub fn validate_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid(
            "the resource name is empty; give a name of 1 to 256 bytes",
        ));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(Error::invalid(format!(
            "the resource name is {} bytes long; the limit is {MAX_NAME_BYTES} bytes",
            name.len()
        )));
    }
    // Printable ASCII, the usual name, is told byte by byte; only other names are decoded.
    if name.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Ok(());
    }
    if let Some((at, c)) = name.char_indices().find(|(_, c)| c.is_control()) {
        return Err(Error::invalid(format!(
            "the resource name {name:?} contains the control character U+{:04X} at byte {at}; \
             names may not contain control characters",
            c as u32
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;
    use proptest::prelude::*;

    #[test]
    fn accepts_ordinary_names() {
        for n in [
            "a",
            "nightly-invoices",
            "a:fence",
            "{a}",
            "a}",
            "ünïcødé/€",
            " spaced ",
        ] {
            assert!(validate_name(n).is_ok(), "{n:?}");
        }
        assert!(validate_name(&"x".repeat(256)).is_ok());
    }

    #[test]
    fn rejects_empty_long_and_control() {
        for n in [
            String::new(),
            "x".repeat(257),
            "a\nb".into(),
            "tab\t".into(),
            "\u{7f}".into(),
            "\u{85}".into(),
        ] {
            let e = validate_name(&n).expect_err(&n);
            assert_eq!(e.kind(), ErrorKind::InvalidInput);
        }
    }

    #[test]
    fn multibyte_limit_counts_bytes() {
        // 86 three-byte characters: 258 bytes, over the limit though only 86 characters.
        let n = "€".repeat(86);
        assert!(validate_name(&n).is_err());
        assert!(validate_name(&"€".repeat(85)).is_ok());
    }

    proptest! {
        #[test]
        fn valid_iff_length_and_no_control(s in "\\PC{0,100}|.{0,300}") {
            let expect = !s.is_empty() && s.len() <= MAX_NAME_BYTES && !s.chars().any(char::is_control);
            prop_assert_eq!(validate_name(&s).is_ok(), expect);
        }
    }
}
