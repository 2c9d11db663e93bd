"""The same two sentences in several languages, and a short code snippet: the texts that
`tokenmill tokenize --compare` counts a tokenizer's tokens on, to show its cost per language."""

from __future__ import annotations

REFERENCE = "English"

TRANSLATIONS = {
    "English": "The weather is nice today, so we are walking to the park. "
               "Would you like to come with us?",
    "Japanese": "今日は天気がいいので、私たちは公園まで歩いて行きます。一緒に来ませんか？",
    "Chinese": "今天天气很好，所以我们走路去公园。你想和我们一起去吗？",
    "Korean": "오늘은 날씨가 좋아서 우리는 공원까지 걸어갑니다. 우리와 같이 가실래요?",
    "Arabic": "الطقس جميل اليوم، لذلك سنمشي إلى الحديقة. هل تود أن تأتي معنا؟",
    "Hindi": "आज मौसम अच्छा है, इसलिए हम पैदल पार्क जा रहे हैं। क्या आप हमारे साथ आना चाहेंगे?",
}

CODE = '''def mean(values: list[float]) -> float:
    """The average of a non-empty list."""
    return sum(values) / len(values)
'''

SAMPLES = {**TRANSLATIONS, "code (Python)": CODE}
