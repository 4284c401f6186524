"""Token co-occurrence statistics (unigram, bigram, trigram counts) and fast mask lookup."""
