-- Argo CD health check for serving.mooncake-operator.dev/MooncakeServing (Lua 5.1, as gopher-lua runs it).
-- Install it as resource.customizations.health.serving.mooncake-operator.dev_MooncakeServing in argocd-cm
-- (docs/gitops.md). It reads the status as kstatus (Flux, `kubectl wait`) does, so both tell one story:
-- an older generation or Reconciling=True is Progressing, Stalled=True is Degraded, Ready=True is
-- Healthy, anything else Progressing. The phase and Ready's reason only word the message.
local hs = {status = "Progressing", message = "Waiting for the operator to report status"}
local status = obj.status
if status == nil then
  return hs
end

local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration ~= generation) then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local conditions = status.conditions or {}
local ready = nil
for _, c in ipairs(conditions) do
  if c.type == "Ready" then
    ready = c
  end
end

local detail = status.phase or "Pending"
if ready ~= nil then
  if ready.reason ~= nil and ready.reason ~= "" and ready.reason ~= detail then
    detail = detail .. " (" .. ready.reason .. ")"
  end
  if ready.message ~= nil and ready.message ~= "" then
    detail = detail .. ": " .. ready.message
  end
end
hs.message = detail

-- The first of Reconciling and Stalled that is True decides, in the order they are listed (as kstatus).
for _, c in ipairs(conditions) do
  if c.type == "Reconciling" and c.status == "True" then
    return hs
  end
  if c.type == "Stalled" and c.status == "True" then
    hs.status = "Degraded"
    return hs
  end
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
end
return hs
