"""Planning side: datasets, chat templates and loss masks, batching, the plan, enqueueing, status."""
