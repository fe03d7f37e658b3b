//! The command line with its help text fitted to a terminal of [`WIDTH`] columns.
//!
//! clap prints each paragraph of a doc comment as one line (it wraps only with a feature possum
//! does not build with), so every text is wrapped here: a command's own text at `WIDTH`, the
//! commands listed under `Commands:` after their names, and each option's help on the line
//! below the option, indented as clap indents it there.

use clap::{Arg, Command};

/// The widest line `--help` prints.
pub const WIDTH: usize = 100;

/// Where clap starts an option's help when it is on the line below the option.
const NEXT_LINE_INDENT: usize = 10;

/// `cmd` and its subcommands, their texts wrapped to fit [`WIDTH`] columns.
pub fn fit(cmd: Command) -> Command {
    // A subcommand's summary is listed after the longest name and two spaces on each side.
    let column = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .map(|s| s.get_name().len())
        .max()
        .unwrap_or(0)
        + 4;
    let mut cmd = cmd.mut_args(fit_arg).mut_subcommands(|s| {
        let s = match s.get_about().map(|a| a.to_string()) {
            Some(a) => s.about(wrap(&a, WIDTH.saturating_sub(column))),
            None => s,
        };
        fit(s)
    });
    if let Some(a) = cmd.get_long_about().map(|a| a.to_string()) {
        cmd = cmd.long_about(wrap(&a, WIDTH));
    }
    cmd
}

/// An option with its help on the line below it, wrapped to fit there; the short help leaves
/// room for what clap appends on its last line (`[default: ..]`, ...).
fn fit_arg(a: Arg) -> Arg {
    let room = WIDTH - NEXT_LINE_INDENT;
    let mut a = a.next_line_help(true);
    if let Some(h) = a.get_help().map(|h| h.to_string()) {
        let tail = appended_len(&a);
        a = a.help(wrap_before(&h, room, tail));
    }
    if let Some(h) = a.get_long_help().map(|h| h.to_string()) {
        a = a.long_help(wrap(&h, room));
    }
    a
}

/// `text` wrapped at `width`, its last line short enough for `tail` more characters after it.
fn wrap_before(text: &str, width: usize, tail: usize) -> String {
    let wrapped = wrap(text, width);
    let last = wrapped.lines().last().unwrap_or_default();
    if tail == 0 || last.chars().count() + tail <= width {
        return wrapped;
    }
    let head = &wrapped[..wrapped.len() - last.len()];
    format!("{head}{}", wrap(last, width.saturating_sub(tail).max(10)))
}

/// About how wide the brackets are that clap appends to an option's short help: its defaults,
/// possible values and visible aliases, each `[..] `.
fn appended_len(a: &Arg) -> usize {
    let mut n = 0;
    let defaults: Vec<String> = a
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    if !defaults.is_empty() {
        n += "[default: ] ".len() + defaults.join(", ").len();
    }
    let values: Vec<String> = a
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set())
        .map(|v| v.get_name().to_string())
        .collect();
    if !values.is_empty() && a.get_action().takes_values() {
        n += "[possible values: ] ".len() + values.join(", ").len();
    }
    if let Some(aliases) = a.get_visible_aliases() {
        n += "[aliases: ] ".len() + aliases.iter().map(|s| s.len() + 4).sum::<usize>();
    }
    n
}

/// `text` with each line broken at spaces into lines of at most `width` characters (a word
/// longer than that stays whole); blank lines and each line's indentation are kept.
pub fn wrap(text: &str, width: usize) -> String {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        let indent: String = line.chars().take_while(|c| *c == ' ').collect();
        let mut current = String::new();
        for word in line.split_whitespace() {
            if !current.is_empty() && current.chars().count() + 1 + word.chars().count() > width {
                out.push(std::mem::take(&mut current));
            }
            if current.is_empty() {
                current.push_str(&indent);
            } else {
                current.push(' ');
            }
            current.push_str(word);
        }
        out.push(current);
    }
    out.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrap_breaks_at_spaces_and_keeps_paragraphs() {
        assert_eq!(wrap("aa bb cc", 5), "aa bb\ncc");
        assert_eq!(wrap("one\n\ntwo three", 4), "one\n\ntwo\nthree");
        assert_eq!(wrap("averylongword x", 4), "averylongword\nx");
        assert_eq!(wrap("  - a b", 5), "  - a\n  b");
    }
}
