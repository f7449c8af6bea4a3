"""Upstream differences that several ports share, each written once with its reason.

A port lists the records that apply in its ``upstream_differences``, where
``docs/upstream-differences.md`` and the tests read them. A record of one port stays in its file.
"""

from __future__ import annotations

from .card import UpstreamDifference

#: The training loss's mask, shared by the ports whose upstream masks by task (L2P, DualPrompt,
#: CODA-Prompt, fine-tuning).
BATCH_LOGIT_MASK = UpstreamDifference(
    "batch_logit_mask",
    "The cross-entropy masks the logits of the classes absent from the training batch, where "
    "upstream's masks those outside the current task.",
    "Online there is no task to mask by; the paper trains every method with the batch-wise mask "
    "(its appendix, `logit_mask: batch`).",
)


#: The head of the ports that train one linear classifier (fine-tuning, iCaRL, DGR).
ONE_LINEAR_HEAD = UpstreamDifference(
    "one_linear_head_over_every_class",
    "The head is one linear layer over every class of the stream, made at build, where "
    "upstream's update_fc grows it by each task's classes at the task's start.",
    "Online the classes of the stream are known up front but no task start is seen.",
)


#: The replay methods' training mask (iCaRL, DGR, COIL, DER, MEMO): upstream's cross-entropy covers
#: every class its head has grown to.
REPLAY_LOGIT_MASK = UpstreamDifference(
    "batch_logit_mask",
    "The cross-entropy masks the logits of the classes absent from the training batch "
    "(stream and replayed rows), where upstream's covers every class its head has grown "
    "to.",
    "The paper trains every method with the batch-wise mask (its appendix); with replay "
    "the batch holds old classes, and `logit_mask: seen` is upstream's reading.",
)


#: The replay methods' memory (iCaRL, DGR, COIL, DER, MEMO): upstream's herding, online.
ONLINE_HERDING = UpstreamDifference(
    "online_herding",
    "Each class's exemplars are re-picked by herding as its samples stream past (over "
    "its stored exemplars and its samples in the batch, against the running mean of its "
    "streamed features, computed by the training forward), where upstream herds once, "
    "at the task end, over the class's whole data through the final network.",
    "One pass keeps no images beyond the memory, so a class's whole data is never "
    "available at once.",
)


#: The distilling methods' teacher (iCaRL, DGR, COIL): the engine's, taken at a firing.
TEACHER_AT_FIRING = UpstreamDifference(
    "teacher_at_firing",
    "The teacher is the network at the last consolidation firing and distils the classes "
    "seen before it, a mask, where upstream copies the network at each task end and "
    "distils the prefix of classes known then.",
    "No task end is seen online; on a clear stream the default trigger fires at each task "
    "boundary, and on Si-Blurry classes arrive in no order.",
)


#: The exemplar methods' evaluation (iCaRL, COIL): the head alone, no nearest-mean-of-exemplars.
LOGITS_ONLY_EVALUATION = UpstreamDifference(
    "logits_only_evaluation",
    "Evaluation predicts with the head's logits only, where upstream also reports "
    "nearest-mean-of-exemplars accuracy from its herding class means.",
    "The paper's tables score every method by its classifier; exemplar means of the "
    "current network would need a pass over the memory at every evaluation.",
)


#: At evaluation each sample picks its own prompts (L2P and DualPrompt).
NO_BATCH_VOTE_AT_EVALUATION = UpstreamDifference(
    "no_batch_vote_at_evaluation",
    "At evaluation each sample selects its own prompts, where upstream keeps the training batch's "
    "majority vote (`batchwise_prompt`).",
    "PILOT's test batches are sorted by class, so a vote would hand the model the batch's task; "
    "`batchwise_prompt_eval: true` restores upstream.",
)


#: The differences RanPAC and FeCAM share (their first session and their statistics).
FIRST_SESSION_DIFFERENCES: tuple[UpstreamDifference, ...] = (
    UpstreamDifference(
        "first_session_until_first_firing",
        "The first session (PETL module and cosine head trained) lasts until the consolidation "
        "trigger's first firing, in one pass, instead of tuned_epoch epochs over the first task.",
        "A task-free stream has no first task; the trigger marks where it would end.",
    ),
    UpstreamDifference(
        "statistics_from_the_first_step",
        "Statistics accumulate from every stream batch as it arrives (training transforms, eval "
        "mode), the first session's from a backbone still training, where upstream passes each "
        "task's data again after training with test transforms.",
        "Online, each sample is seen once: its features must be folded in when it arrives.",
    ),
    UpstreamDifference(
        "unseen_classes_below_seen",
        "A class without statistics yet scores -1e4 plus the first session's head, where "
        "upstream's head has no row for a class of a later task.",
        "The online head covers every class of the stream from the start; evaluation never "
        "allows such a class, and a network that has seen nothing still ranks classes.",
    ),
)
