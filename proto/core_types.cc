#include "proto/core_types.h"

namespace kvcm {

void NamespaceToProto(const NamespaceId& ns, v1::Namespace* out) {
  out->set_tenant(ns.tenant);
  out->set_model(ns.model);
}

void PoolToProto(const PoolKey& pool, v1::PoolRef* out) {
  out->set_agent_id(pool.agent_id);
  out->set_tier(static_cast<v1::Tier>(pool.tier));  // same values
}

void ModelSpecToProto(const ModelSpec& spec, v1::ModelSpec* out) {
  out->set_attention(static_cast<v1::AttentionKind>(spec.attention));  // same values
  out->set_num_layers(spec.num_layers);
  out->set_num_heads(spec.num_heads);
  out->set_num_kv_heads(spec.num_kv_heads);
  out->set_head_dim(spec.head_dim);
  out->set_kv_lora_rank(spec.kv_lora_rank);
  out->set_rope_dim(spec.rope_dim);
  out->set_qk_nope_head_dim(spec.qk_nope_head_dim);
  out->set_v_head_dim(spec.v_head_dim);
  out->set_dtype(static_cast<v1::KvDtype>(spec.dtype));  // same values
  out->set_page_size_tokens(spec.page_size_tokens);
}

}  // namespace kvcm
