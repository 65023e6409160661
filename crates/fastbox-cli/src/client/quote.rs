//! Shell quoting: execd runs a command line with `sh -c` (compat §4.2), so an argv is sent as
//! its words quoted for a POSIX shell.

/// `argv` as one shell command line that runs exactly these words.
pub fn shell_join(argv: &[String]) -> String {
    argv.iter()
        .map(|word| shell_quote(word))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One word, quoted only when the shell would otherwise split or interpret it.
pub fn shell_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"@%+=:,./_-".contains(&b));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_words_stay_as_they_are() {
        assert_eq!(
            shell_join(&["ls".into(), "-la".into(), "/tmp/a_b.c".into()]),
            "ls -la /tmp/a_b.c"
        );
    }

    #[test]
    fn words_with_specials_are_single_quoted() {
        let argv = [
            "sh".to_string(),
            "-c".to_string(),
            "echo out; echo err >&2; exit 3".to_string(),
        ];
        assert_eq!(shell_join(&argv), "sh -c 'echo out; echo err >&2; exit 3'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote("$HOME *"), "'$HOME *'");
    }

    #[test]
    fn a_shell_gives_back_the_same_words() {
        let argv: Vec<String> = ["printf", "%s|", "a b", "it's", "", "$x", "\\n", "*"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(shell_join(&argv))
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8(out.stdout).unwrap(),
            "a b|it's||$x|\\n|*|"
        );
    }
}
