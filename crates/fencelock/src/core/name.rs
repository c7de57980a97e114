//! Resource names: checked before any I/O so that a bad name never reaches an engine.

use crate::core::error::{Error, Result};

/// The longest resource name accepted, in bytes of UTF-8.
pub const MAX_NAME_BYTES: usize = 256;

/// Characters that change how the text around them displays without showing themselves: the
/// bidirectional controls (a name holding U+202E shows reversed, so a list shows one name as
/// another) and the invisible spaces, which make two names look the same. The joiners U+200C
/// and U+200D are not among them: scripts and emoji need them.
const DISGUISING: &[char] = &[
    '\u{061C}', '\u{200B}', '\u{200E}', '\u{200F}', '\u{202A}', '\u{202B}', '\u{202C}', '\u{202D}',
    '\u{202E}', '\u{2060}', '\u{2066}', '\u{2067}', '\u{2068}', '\u{2069}', '\u{FEFF}',
];

/// Checks a resource name: 1 to 256 bytes of UTF-8 without control characters, bidirectional
/// controls (U+061C, U+200E, U+200F, U+202A to U+202E, U+2066 to U+2069) or invisible spaces
/// (U+200B, U+2060, U+FEFF).
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
    if let Some((at, c)) = name.char_indices().find(|(_, c)| DISGUISING.contains(c)) {
        return Err(Error::invalid(format!(
            "the resource name {name:?} contains U+{:04X} at byte {at}, which changes the \
             direction of the text around it or is invisible; names may not contain such \
             characters, which make one name display as another",
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

    /// A name holding U+202E was accepted, and a dashboard showed it reversed.
    #[test]
    fn rejects_direction_controls_and_invisible_characters() {
        for c in [
            '\u{061C}', '\u{200B}', '\u{200E}', '\u{200F}', '\u{202A}', '\u{202B}', '\u{202C}',
            '\u{202D}', '\u{202E}', '\u{2060}', '\u{2066}', '\u{2067}', '\u{2068}', '\u{2069}',
            '\u{FEFF}',
        ] {
            let n = format!("invoice{c}fdp.exe");
            let e = validate_name(&n).expect_err(&n);
            assert_eq!(e.kind(), ErrorKind::InvalidInput);
            assert!(
                e.to_string().contains(&format!("U+{:04X}", c as u32)),
                "{e}"
            );
        }
        // Joiners that scripts and emoji need stay allowed.
        assert!(validate_name("\u{0645}\u{06CC}\u{200C}\u{062E}\u{0648}\u{0627}\u{0645}").is_ok());
        assert!(validate_name("\u{1F469}\u{200D}\u{1F4BB}").is_ok());
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
        fn valid_iff_length_and_no_control(s in "\\PC{0,100}|.{0,300}|[a\u{200B}-\u{200F}\u{202A}-\u{202E}\u{2066}-\u{2069}]{1,8}") {
            let refused = |c: char| {
                c.is_control()
                    || matches!(c, '\u{061C}' | '\u{200B}' | '\u{200E}' | '\u{200F}' | '\u{2060}' | '\u{FEFF}')
                    || ('\u{202A}'..='\u{202E}').contains(&c)
                    || ('\u{2066}'..='\u{2069}').contains(&c)
            };
            let expect = !s.is_empty() && s.len() <= MAX_NAME_BYTES && !s.chars().any(refused);
            prop_assert_eq!(validate_name(&s).is_ok(), expect);
        }
    }
}
