"""A reply's tokens in the report: `report.tokens_html` renders the spans the `tokens` macro of _macros.html
rendered with a template loop per token (the report's largest cost before). Pinned here against that loop, kept
verbatim, on views with every mark, tokens that decode to nothing, per-token KL and text that must be escaped."""

from __future__ import annotations

import jinja2

from harness.runs.report import environment, tokens_html

# the macro's former body, verbatim
TEMPLATE_LOOP = ("{% for t in view %}<span class=\"tok {{ t.mark }}{{ ' empty' if t.empty }}{{ ' kl' if t.get('kl') }}\""
                 "{% if t.get('kl') %} style=\"border-bottom-color: {{ t.kl.colour }}\"{% endif %} title=\"token "
                 "{{ t.index }}{{ ' (decodes to nothing)' if t.empty }}{% if t.get('kl') %}, KL {{ t.kl.text }}"
                 "{% endif %}\">{{ t.text }}</span>{% endfor %}")

VIEW = [
    {"text": "Hello", "mark": "same", "index": 0, "empty": False},
    {"text": " <b>&\"'</b>", "mark": "first-div", "index": 1, "empty": False, "kl": {"colour": "#e8efe8", "text": "0"}},
    {"text": "\u27e8128000\u27e9", "mark": "after", "index": 2, "empty": True, "kl": None},
    {"text": "x", "mark": "after", "index": 3, "empty": False, "kl": {"colour": "#d9534f", "text": "3.2e+01 <"}},
]


def test_the_token_spans_are_the_template_loops():
    loop = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string(TEMPLATE_LOOP)
    assert str(tokens_html(VIEW)) == loop.render(view=VIEW)
    assert str(tokens_html([])) == ""


def test_the_report_macro_renders_through_it():
    rendered = environment().from_string('{% import "_macros.html" as m %}{{ m.tokens(view) }}').render(view=VIEW)
    assert rendered == str(tokens_html(VIEW)) and "&lt;b&gt;&amp;&#34;&#39;&lt;/b&gt;" in rendered
