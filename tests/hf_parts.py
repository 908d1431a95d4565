"""A tiny GPT-2 (random weights from a config) and a word-level tokenizer built in memory: nothing is downloaded."""
import torch


def tokenizer(n_words=40):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {'[PAD]': 0, '[UNK]': 1, **{f'w{i}': i + 2 for i in range(n_words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token='[PAD]', unk_token='[UNK]')


def sentences(n, n_words=40, lo=3, hi=20, seed=0):
    "`n` sentences of `lo` to `hi` random words."
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [' '.join(f'w{i}' for i in torch.randint(0, n_words, (k,), generator=g).tolist()) for k in lens]


def lm_data(n, seed=0):
    "`(examples, collator)`: tokenized sentences, and the collator that pads them and makes the labels (-100 at pads)."
    from transformers import DataCollatorForLanguageModeling
    tok = tokenizer()
    return [tok(s) for s in sentences(n, seed=seed)], DataCollatorForLanguageModeling(tok, mlm=False)


def gpt2(vocab_size=42, n_embd=32, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=n_embd, n_layer=2, n_head=2, bos_token_id=1,
                     eos_token_id=1, pad_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def argmax(preds, targets): return preds.argmax(-1)


def token_accuracy(preds, labels):
    "Share of next-token predictions (argmax ids at position t for the token at t + 1) right, padding (-100) skipped."
    p, y = preds[:, :-1], labels[:, 1:]
    keep = y != -100
    return (p[keep] == y[keep]).double().mean()


def by_hand(model, examples):
    "`(logits per sequence, token accuracy)`, each sequence run alone (no padding)."
    logits, right, total = [], 0, 0
    model.eval()   # (no dropout)
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor(ex['input_ids'])
            lg = model(input_ids=ids[None]).logits[0]
            logits.append(lg)
            right += (lg.argmax(-1)[:-1] == ids[1:]).sum().item()
            total += len(ids) - 1
    return logits, right / total


def top2_gap(logits) -> float:
    "The smallest gap between the two largest logits of any position (how close an argmax came to a tie)."
    return min((lg.topk(2, -1).values[:, 0] - lg.topk(2, -1).values[:, 1]).min().item() for lg in logits)
