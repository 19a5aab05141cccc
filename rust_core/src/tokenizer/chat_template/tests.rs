//! Rendering behaviour that chat templates rely on. Expected strings were produced by
//! transformers' own renderer (`render_jinja_template` after `_normalize_chat_messages`, Jinja2
//! 3.1.6) on the same template and messages.

use serde_json::{json, Map, Value as Json};

use super::*;

fn render_with(template: &str, messages: Json, extra: Json) -> Result<String> {
    let extra: Map<String, Json> = extra.as_object().cloned().unwrap_or_default();
    ChatTemplate::new(template)?.render(&messages, None, true, &extra)
}

fn render(template: &str, messages: Json) -> String {
    render_with(template, messages, json!({})).unwrap()
}

#[test]
fn trim_and_lstrip_blocks_match_jinja2() {
    let template = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}\nend\n";
    let messages = json!([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}, {"role": "user", "content": "c"}]);
    assert_eq!(render(template, messages), "[a]\n[c]\nend");
}

#[test]
fn printed_values_use_python_str() {
    let template = "{{ 1e16 }}|{{ 0.00001 }}|{{ {'a': 1, 'b': [true, none, 'x']} }}|{{ true }}|{{ none }}|{{ messages[0].missing }}|{{ messages[0] | string }}";
    let out = render(template, json!([{"role": "user", "content": "it's"}]));
    assert_eq!(out, r#"1e+16|1e-05|{'a': 1, 'b': [True, None, 'x']}|True|None||{'role': 'user', 'content': "it's"}"#);
}

#[test]
fn tojson_is_python_json_dumps() {
    let template = "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ messages[0].content | tojson(ensure_ascii=true) }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=true, separators=(',', ':')) }}";
    let out = render(template, json!([{"role": "user", "content": "<b>é & \"q\"</b>", "n": 1.5}]));
    let want = "{\"role\": \"user\", \"content\": \"<b>é & \\\"q\\\"</b>\", \"n\": 1.5}|{\n  \"role\": \"user\",\n  \"content\": \"<b>é & \\\"q\\\"</b>\",\n  \"n\": 1.5\n}|\"<b>\\u00e9 & \\\"q\\\"</b>\"|{\"a\":2,\"b\":1}";
    assert_eq!(out, want);
}

#[test]
fn python_string_and_dict_methods_work() {
    let template = "{{ messages[0].content.strip().split('|') | join(',') }};{{ messages[0].content.startswith(' a') }};{{ messages[0].content.rstrip() | length }};{% for k, v in messages[0].items() %}{{ k }}={{ v | trim }} {% endfor %};{{ messages[0].get('nope', 'dflt') }};{{ messages[0].content.lstrip().upper() }}";
    let out = render(template, json!([{"role": "user", "content": " a|b|c "}]));
    assert_eq!(out, "a,b,c;True;6;role=user content=a|b|c ;dflt;A|B|C ");
}

#[test]
fn namespace_loop_controls_and_reverse_slices_work() {
    let template = "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}{% if m.role == 'stop' %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{{ loop.index0 }}{{ 'L' if loop.last else '' }}{% endfor %}#{{ ns.n }}{{ messages[::-1][0].role }}";
    let messages = json!([{"role": "a"}, {"role": "skip"}, {"role": "b"}, {"role": "stop"}, {"role": "c"}]);
    assert_eq!(render(template, messages), "02#2c");
}

#[test]
fn null_keys_are_dropped_and_reasoning_is_aliased() {
    let template = "{% for m in messages %}{{ 'tc' if m.tool_calls is defined else 'none' }},{{ m.reasoning_content | default('-') }},{{ m.thinking | default('-') }};{% endfor %}{{ messages[1] | tojson }}";
    let messages = json!([
        {"role": "assistant", "content": "x", "tool_calls": null},
        {"role": "assistant", "content": "y", "reasoning": "r1", "thinking": null}
    ]);
    let want = r#"none,-,-;none,r1,r1;{"thinking": "r1", "role": "assistant", "content": "y", "reasoning": "r1", "reasoning_content": "r1"}"#;
    assert_eq!(render(template, messages), want);
}

#[test]
fn iterable_and_sequence_tests_follow_python() {
    let template = "{{ none is iterable }}{{ 'ab' is iterable }}{{ {} is iterable }}{{ x is iterable }}{{ 1 is iterable }}|{{ 'ab' is sequence }}{{ {} is sequence }}{{ [] is sequence }}{{ none is sequence }}{{ x is sequence }}{{ 1 is sequence }}|{{ true is number }}";
    let out = render(template, json!([{"role": "user", "content": "x"}]));
    assert_eq!(out, "FalseTrueTrueTrueFalse|TrueTrueTrueFalseTrueFalse|True");
}

#[test]
fn generation_tags_render_their_body() {
    let template = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}\n{%- generation -%}\n  !{% endgeneration %}{% endfor %}";
    assert_eq!(render(template, json!([{"role": "user", "content": "hi"}])), "hi!");
}

#[test]
fn extra_kwargs_tools_and_documents_are_visible() {
    let template = "{{ bos_token }}{% if enable_thinking is defined and enable_thinking is false %}nothink{% endif %}{{ 'gen' if add_generation_prompt }}{{ tools is none }}{{ documents is none }}";
    let out = render_with(template, json!([{"role": "user", "content": "hi"}]), json!({"bos_token": "<s>", "enable_thinking": false})).unwrap();
    assert_eq!(out, "<s>nothinkgenTrueTrue");
}

#[test]
fn raise_exception_becomes_a_template_error_with_its_message() {
    let template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok";
    let err = render_with(template, json!([{"role": "system", "content": "x"}]), json!({})).unwrap_err();
    match err {
        NinferError::Template(text) => assert!(text.contains("first message must be from the user"), "{text}"),
        other => panic!("expected a template error, got {other:?}"),
    }
}

#[test]
fn strftime_now_formats_the_current_date() {
    let out = render("{{ strftime_now('%Y-%m-%d') }}", json!([{"role": "user", "content": "hi"}]));
    assert_eq!(out, CivilTime::now().format("%Y-%m-%d"));
}

#[test]
fn malformed_template_fails_to_compile() {
    let err = ChatTemplate::new("{% for m in messages %}{{ m.content }}").unwrap_err();
    assert!(matches!(err, NinferError::Template(_)), "{err:?}");
}

#[test]
fn bad_messages_are_invalid_requests() {
    let template = ChatTemplate::new("{{ messages | length }}").unwrap();
    let none = Map::new();
    for (messages, field) in [(json!([]), "messages"), (json!({"role": "user"}), "messages"), (json!(["hi"]), "messages[0]")] {
        match template.render(&messages, None, false, &none).unwrap_err() {
            NinferError::InvalidRequest { field: got, .. } => assert_eq!(got, field),
            other => panic!("expected an invalid request for {messages}, got {other:?}"),
        }
    }
    let reserved: Map<String, Json> = json!({"messages": []}).as_object().cloned().unwrap();
    assert!(matches!(
        template.render(&json!([{"role": "user", "content": "x"}]), None, false, &reserved),
        Err(NinferError::InvalidRequest { .. })
    ));
}

fn fixture(name: &str) -> String {
    let path = format!("{}/../tests/templates/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn qwen3_fixture_renders_tool_calls_with_string_or_object_arguments() {
    let template = ChatTemplate::new(&fixture("qwen3.jinja")).unwrap();
    let messages = json!([
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"CET\"}"}}
        ]},
        {"role": "tool", "content": "21C"}
    ]);
    let mut extra = Map::new();
    extra.insert("enable_thinking".into(), json!(false));
    let out = template.render(&messages, None, true, &extra).unwrap();
    let want = "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n21C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
    assert_eq!(out, want);
}
