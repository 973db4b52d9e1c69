// SPDX-License-Identifier: MIT OR Apache-2.0
//! Finds the `extern "C" __global__` entry points of a CUDA source, so their names reach Rust as
//! generated constants instead of hand-typed strings.

/// The names of the `extern "C"` `__global__` functions defined in `text`, in order.
///
/// Comments are stripped first; `__launch_bounds__(...)` between the return type and the name is
/// skipped. Kernels without `extern "C"` are ignored: their names are mangled and cannot be looked
/// up by name from Rust.
pub fn kernel_functions(text: &str) -> Vec<String> {
    let code = strip_comments(text);
    let mut names = Vec::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("__global__") {
        let before = &rest[..at];
        let after = &rest[at + "__global__".len()..];
        rest = after;
        // The `extern "C"` must close the declaration's prefix (same statement).
        let statement_start = before.rfind([';', '}', '{']).map_or(0, |i| i + 1);
        if !before[statement_start..].contains("extern \"C\"") {
            continue;
        }
        let head = skip_launch_bounds(after);
        let Some(paren) = head.find('(') else {
            continue;
        };
        let name: String = head[..paren]
            .trim_end()
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        if !name.is_empty() {
            names.push(name);
        }
    }
    names
}

fn skip_launch_bounds(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find("__launch_bounds__") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "__launch_bounds__".len()..];
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '/' && chars.peek() == Some(&'/') {
            for c in chars.by_ref() {
                if c == '\n' {
                    out.push('\n');
                    break;
                }
            }
        } else if c == '/' && chars.peek() == Some(&'*') {
            chars.next();
            let mut prev = ' ';
            for c in chars.by_ref() {
                if prev == '*' && c == '/' {
                    break;
                }
                prev = c;
            }
            out.push(' ');
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_extern_c_kernels() {
        let src = r#"
            // extern "C" __global__ void commented_out(int x) {}
            /* extern "C" __global__ void also_commented(int x) {} */
            extern "C" __global__ void __launch_bounds__(256, 2) rmsnorm_bf16(float* out) {}
            extern "C" {
            __global__ void inside_block(int n) {}
            }
            __global__ void mangled(int n) {}
            template <int N> __device__ void helper() {}
            extern "C" __global__ void
            split_line_kernel (int n) {}
        "#;
        assert_eq!(
            kernel_functions(src),
            vec!["rmsnorm_bf16", "split_line_kernel"]
        );
    }
}
