//! The text cache_aware routes on, taken from a request body: `/generate` `text` or
//! `input_ids`, `/v1/completions` `prompt`, `/v1/chat/completions` `messages` (role and text
//! parts, in order). Token ids become 4 little-endian bytes each, so id prefixes match like
//! text prefixes. For a batch, the first element routes the whole request.

use serde_json::Value;

fn push_ids(out: &mut Vec<u8>, ids: &[Value]) {
    for id in ids {
        if let Some(n) = id.as_u64() {
            out.extend_from_slice(&(n as u32).to_le_bytes());
        }
    }
}

fn push_prompt(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::String(s) => out.extend_from_slice(s.as_bytes()),
        Value::Array(items) => match items.first() {
            Some(Value::Number(_)) => push_ids(out, items),
            Some(first) => push_prompt(out, first),
            None => {}
        },
        _ => {}
    }
}

fn push_content(out: &mut Vec<u8>, content: &Value) {
    match content {
        Value::String(s) => out.extend_from_slice(s.as_bytes()),
        Value::Array(parts) => {
            for p in parts {
                if let Some(t) = p.get("text").and_then(Value::as_str) {
                    out.extend_from_slice(t.as_bytes());
                }
            }
        }
        _ => {}
    }
}

/// Routing text of a request body, by route.
pub fn routing_text(path: &str, body: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    match path {
        "/v1/chat/completions" => {
            if let Some(msgs) = body.get("messages").and_then(Value::as_array) {
                for m in msgs {
                    if let Some(r) = m.get("role").and_then(Value::as_str) {
                        out.extend_from_slice(r.as_bytes());
                        out.push(b'\n');
                    }
                    if let Some(c) = m.get("content") {
                        push_content(&mut out, c);
                    }
                    out.push(b'\n');
                }
            }
        }
        "/v1/completions" => {
            if let Some(p) = body.get("prompt") {
                push_prompt(&mut out, p);
            }
        }
        _ => {
            if let Some(t) = body.get("text") {
                push_prompt(&mut out, t);
            } else if let Some(ids) = body.get("input_ids") {
                push_prompt(&mut out, ids);
            }
        }
    }
    out
}

/// Number of requests in a `/generate` batch (`text` or `input_ids` as a list), if it is one.
pub fn batch_size(path: &str, body: &Value) -> Option<usize> {
    if path != "/generate" {
        return None;
    }
    let v = body.get("text").or_else(|| body.get("input_ids"))?;
    match v.as_array()?.first()? {
        Value::Number(_) => None,
        _ => Some(v.as_array()?.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn each_route_yields_its_prompt_text() {
        assert_eq!(routing_text("/generate", &json!({"text": "hello"})), b"hello");
        assert_eq!(routing_text("/generate", &json!({"text": ["a", "b"]})), b"a");
        assert_eq!(routing_text("/generate", &json!({"input_ids": [1, 2]})), vec![1, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(routing_text("/v1/completions", &json!({"prompt": "p"})), b"p");
        let chat = json!({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]});
        assert_eq!(routing_text("/v1/chat/completions", &chat), b"system\nS\nuser\nU\n");
        assert_eq!(routing_text("/generate", &json!({})), b"");
    }

    #[test]
    fn batches_are_recognised_only_for_lists_of_prompts() {
        assert_eq!(batch_size("/generate", &json!({"text": ["a", "b", "c"]})), Some(3));
        assert_eq!(batch_size("/generate", &json!({"input_ids": [[1], [2]]})), Some(2));
        assert_eq!(batch_size("/generate", &json!({"input_ids": [1, 2]})), None);
        assert_eq!(batch_size("/generate", &json!({"text": "a"})), None);
        assert_eq!(batch_size("/v1/completions", &json!({"prompt": ["a"]})), None);
    }
}
