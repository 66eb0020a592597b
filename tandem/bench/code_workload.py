"""A code workload of our own for the speculation bench (`--workload code`): edits of code given
in the prompt (add type hints or a docstring, rename, fix a bug, restructure), where an answer
repeats much of its prompt, as code assistants' answers do. Written for tandem; not HumanEval or
any public benchmark, which stays out of everything we tune on."""

_SNIPPETS = {
    "moving_average": '''def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        total = 0
        for j in range(window):
            total += values[i + j]
        result.append(total / window)
    return result''',
    "parse_config": '''def parse_config(text):
    config = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config''',
    "lru_cache": '''class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key):
        if key not in self.items:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)''',
    "word_counts": '''def word_counts(path):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.lower().split():
                word = word.strip(".,;:!?")
                if word:
                    counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: kv[1], reverse=True)''',
    "binary_search": '''def binary_search(items, target):
    low, high = 0, len(items)
    while low < high:
        mid = (low + high) // 2
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid
    if low < len(items) and items[low] == target:
        return low
    return -1''',
    "retry": '''import time

def retry(call, attempts, delay):
    last_error = None
    for attempt in range(attempts):
        try:
            return call()
        except Exception as error:
            last_error = error
            time.sleep(delay * (2 ** attempt))
    raise last_error''',
    "merge_intervals": '''def merge_intervals(intervals):
    intervals = sorted(intervals)
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged''',
    "js_debounce": '''function debounce(fn, wait) {
  let timer = null;
  return function (...args) {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), wait);
  };
}''',
}

_TASKS = (
    ("moving_average", "Add type hints and a docstring to this Python function. Reply with the whole function."),
    ("parse_config", "Rename the variable `config` to `settings` everywhere in this function and show the result."),
    ("lru_cache", "Rewrite this class to use collections.OrderedDict, keeping the same methods."),
    ("word_counts", "Add type hints to this function and return only the 10 most common words. Show the full code."),
    ("binary_search", "Add a docstring and comments explaining each step of this function. Show the full code."),
    ("retry", "Change this function so that it only retries on ConnectionError. Reply with the full code."),
    ("merge_intervals", "Add type hints to this function and a short example of its use."),
    ("js_debounce", "Translate this JavaScript function to TypeScript with types."),
    ("moving_average", "Rewrite this function to run in linear time with a running sum. Show the full code."),
    ("parse_config", "Make this function ignore lines without '=' instead of failing. Show the whole function."),
    ("lru_cache", "Add type hints and docstrings to every method of this class. Reply with the whole class."),
    ("word_counts", "Rewrite this function with collections.Counter. Show the full code."),
    ("binary_search", "Write unit tests with pytest for this function."),
    ("retry", "Add logging of each failed attempt to this function. Reply with the full code."),
    ("merge_intervals", "Make this function return tuples instead of lists and not change its input. Show the code."),
    ("js_debounce", "Add JSDoc comments to this function and show the full code."),
)


def code_prompts() -> list[str]:
    """The workload's user turns, in a fixed order."""
    return [f"{task}\n\n```\n{_SNIPPETS[name]}\n```" for name, task in _TASKS]
