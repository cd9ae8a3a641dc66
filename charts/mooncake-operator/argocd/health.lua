-- Argo CD health check for serving.mooncake-operator.dev/MooncakeServing (Lua 5.1, as gopher-lua runs it).
-- Install it as resource.customizations.health.serving.mooncake-operator.dev_MooncakeServing in argocd-cm
-- (docs/gitops.md). Healthy only when the operator observed this generation and Ready is True; Degraded
-- when the spec is Invalid, the canary failed, or the operator is Stalled; Progressing otherwise.
local hs = {status = "Progressing", message = "Waiting for the operator to report status"}
local status = obj.status
if status == nil then
  return hs
end

local function condition(kind)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local phase = status.phase or "Pending"
local ready = condition("Ready")
local stalled = condition("Stalled")
local detail = phase
if ready ~= nil and ready.message ~= nil and ready.message ~= "" then
  detail = phase .. ": " .. ready.message
end

if phase == "Invalid" or phase == "CanaryFailed" or (stalled ~= nil and stalled.status == "True") then
  hs.status = "Degraded"
  hs.message = detail
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = detail
  return hs
end
hs.message = detail
return hs
